"""E2M1 / E4M3 / UE4M3 encode and decode, packing and the group quantizers (flashinfer_h3.formats).

Expected codes are written out by hand; the random checks compare against torch's own
float8_e4m3fn cast and against a slow exact-rational encoder written here.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from flashinfer_h3 import formats as F


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def assert_codes(got: torch.Tensor, want: list[int], inputs) -> None:
    assert got.dtype == torch.uint8
    if got.tolist() != want:
        bad = [
            (x, hex(g), hex(w))
            for x, g, w in zip(inputs, got.tolist(), want, strict=True)
            if g != w
        ]
        raise AssertionError(f"(input, got, want) mismatches: {bad}")


def all_e4m3_bytes() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8)


def torch_e4m3_values() -> torch.Tensor:
    return all_e4m3_bytes().view(torch.float8_e4m3fn).float()


# ---------------------------------------------------------------------------------------------
# E4M3
# ---------------------------------------------------------------------------------------------


def test_e4m3_decode_all_256_patterns_matches_torch():
    got = F.e4m3_to_float(all_e4m3_bytes())
    want = torch_e4m3_values()
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert got.isnan().nonzero().flatten().tolist() == [0x7F, 0xFF]
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])
    # Sign of zero survives the decode.
    assert torch.signbit(got[0x80]) and not torch.signbit(got[0x00])


def test_e4m3_every_finite_pattern_reencodes_to_itself():
    b = all_e4m3_bytes()
    back = F.rn_e4m3(F.e4m3_to_float(b))
    finite = torch.ones(256, dtype=torch.bool)
    finite[[0x7F, 0xFF]] = False
    assert torch.equal(back[finite], b[finite])  # includes 0x80 (-0) and all subnormals


# (input, expected byte): RN-even ties, subnormals, saturation, signed zero.
E4M3_CASES = [
    (0.0, 0x00),
    (-0.0, 0x80),
    (1.0, 0x38),
    (1.0625, 0x38),  # tie 1.0 | 1.125 -> even mantissa 0
    (1.1875, 0x3A),  # tie 1.125 | 1.25 -> even mantissa 2
    (1.9375, 0x40),  # tie 1.875 | 2.0 -> carries into the next binade
    (248.0, 0x78),  # tie 240 | 256 -> 256
    (432.0, 0x7E),  # tie 416 | 448 -> 448
    (448.0, 0x7E),
    (449.0, 0x7E),
    (464.0, 0x7E),
    (480.0, 0x7E),
    (1e30, 0x7E),  # saturation
    (math.inf, 0x7E),
    (-500.0, 0xFE),
    (-math.inf, 0xFE),
    (2.0**-6, 0x08),  # smallest normal
    (2.0**-9, 0x01),  # smallest subnormal
    (2.0**-10, 0x00),  # tie 0 | 2^-9 -> 0 (even)
    (2.0**-10 * 1.0000001, 0x01),  # just above the tie
    (-(2.0**-10), 0x80),  # rounds to zero, keeps its sign
    (-(2.0**-11), 0x80),
    (3 * 2.0**-10, 0x02),  # tie 2^-9 | 2*2^-9 -> mantissa 2
    (5 * 2.0**-10, 0x02),  # tie 2*2^-9 | 3*2^-9 -> mantissa 2
    (15 * 2.0**-10, 0x08),  # tie 7*2^-9 | 2^-6 -> the normal 0x08 (even)
    (7 * 2.0**-9, 0x07),  # largest subnormal
    (0.1666666716337204, 0x23),  # fp32(1/6): binade [1/8, 1/4), 10.67 ulps -> 11
    (-3.0, 0xC4),
    (0.5, 0x30),
    (240.0, 0x77),
]


def test_e4m3_listed_ties_saturation_and_subnormals():
    xs = [x for x, _ in E4M3_CASES]
    assert_codes(F.rn_e4m3(f32(xs)), [b for _, b in E4M3_CASES], xs)


def test_e4m3_never_nan_for_finite_or_infinite_inputs():
    x = torch.cat([f32([math.inf, -math.inf, 3.4e38, -3.4e38]), torch.randn(10000) * 1e4])
    codes = F.rn_e4m3(x)
    assert not F.e4m3_to_float(codes).isnan().any()
    assert ((codes & 0x7F) <= 0x7E).all()


def test_e4m3_matches_torch_cast_in_range():
    g = torch.Generator().manual_seed(1234)
    n = 200_000
    # Magnitudes spread over 2^-14 .. 2^9 (subnormals, every binade), both signs, clamped to 448.
    mag = torch.rand(n, generator=g) * torch.exp2(torch.randint(-14, 10, (n,), generator=g).float())
    x = (mag * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)).clamp(-448, 448)
    # Add exact ties and exact representable values.
    ties = (torch_e4m3_values()[:0x7E] + torch_e4m3_values()[1:0x7F]) / 2
    x = torch.cat([x, ties, -ties, torch_e4m3_values()[:0x7F]])
    got = F.rn_e4m3(x)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    mismatch = (got != want).nonzero().flatten()
    assert mismatch.numel() == 0, [
        (x[i].item(), got[i].item(), want[i].item()) for i in mismatch[:10]
    ]


def test_e4m3_on_a_non_contiguous_view():
    x = torch.randn(8, 6).t()
    assert torch.equal(F.rn_e4m3(x), F.rn_e4m3(x.contiguous()))


def test_ue4m3_clears_non_positive_inputs():
    assert_codes(
        F.rn_ue4m3(f32([-1.0, -0.0, 0.0, 1.0, 500.0])),
        [0, 0, 0, 0x38, 0x7E],
        [-1.0, -0.0, 0.0, 1.0, 500.0],
    )


def test_e4m3_reciprocal_table_is_correctly_rounded():
    b = all_e4m3_bytes()[1:0x7F]  # positive finite non-zero
    vals = F.e4m3_to_float(b).tolist()
    got = F.e4m3_reciprocal(b).tolist()
    for v, r in zip(vals, got, strict=True):
        exact = Fraction(1) / Fraction(v)
        # r is the FP32 nearest to 1/v: its error is at most half an FP32 ulp of r.
        ulp = Fraction(2) ** (math.frexp(r)[1] - 24)
        assert abs(Fraction(r) - exact) <= ulp / 2, (v, r)
    assert F.e4m3_reciprocal(u8([0, 0x80])).tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------------------------

E2M1_CASES = [
    (0.0, 0x0),
    (-0.0, 0x8),
    (-0.1, 0x8),
    (0.1, 0x0),
    (0.25, 0x0),
    (0.2500001, 0x1),
    (0.5, 0x1),  # tie 0 | 0.5 -> 0
    (0.7499999, 0x1),
    (0.75, 0x2),
    (1.0, 0x2),  # tie 0.5 | 1.0 -> 1.0 (code 2)
    (1.25, 0x2),
    (1.2500001, 0x3),
    (1.5, 0x3),  # tie 1.0 | 1.5 -> 1.0
    (1.7499999, 0x3),
    (1.75, 0x4),
    (2.0, 0x4),  # tie 1.5 | 2.0 -> 2.0
    (2.5, 0x4),
    (2.5000002, 0x5),
    (3.0, 0x5),  # tie 2 | 3 -> 2
    (3.4999998, 0x5),
    (3.5, 0x6),
    (4.0, 0x6),  # tie 3 | 4 -> 4
    (5.0, 0x6),
    (5.0000005, 0x7),
    (6.0, 0x7),  # tie 4 | 6 -> 4
    (6.5, 0x7),
    (100.0, 0x7),
    (math.inf, 0x7),
    (-math.inf, 0xF),  # saturation
    (-0.25, 0x8),
    (-0.75, 0xA),
    (-1.25, 0xA),
    (-1.75, 0xC),
    (-2.5, 0xC),
    (-3.5, 0xE),
    (-5.0, 0xE),
    (-6.0, 0xF),
    (-7.0, 0xF),
]


def test_e2m1_listed_ties_saturation_and_signs():
    xs = [x for x, _ in E2M1_CASES]
    assert_codes(F.rn_e2m1(f32(xs)), [c for _, c in E2M1_CASES], xs)


def slow_e2m1(x: float) -> int:
    """Exact-rational nearest grid value, ties to the even index, saturating."""
    a = Fraction(abs(x)) if math.isfinite(x) else Fraction(7)
    grid = [Fraction(g) for g in F.E2M1_GRID]
    best = min(range(8), key=lambda i: (abs(a - grid[i]), i % 2))
    if a > 6:
        best = 7
    return (8 if math.copysign(1.0, x) < 0 else 0) | best


def test_e2m1_matches_slow_exact_encoder_on_random_inputs():
    g = torch.Generator().manual_seed(7)
    x = torch.cat(
        [
            torch.randn(3000, generator=g) * 3,
            torch.randint(-16, 17, (500,), generator=g).float() / 4,
        ]
    )  # quarters: ties
    got = F.rn_e2m1(x).tolist()
    want = [slow_e2m1(v) for v in x.tolist()]
    assert got == want


def test_e2m1_decode_all_codes():
    assert F.e2m1_to_float(torch.arange(16, dtype=torch.uint8)).tolist() == [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ]
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(F.rn_e2m1(F.e2m1_to_float(codes)), codes)


def test_pack_low_nibble_first_and_roundtrip():
    assert F.pack_e2m1(u8([0x1, 0x2, 0xF, 0x0, 0x8, 0x7])).tolist() == [0x21, 0x0F, 0x78]
    assert F.unpack_e2m1(u8([0x21, 0x0F, 0x78])).tolist() == [0x1, 0x2, 0xF, 0x0, 0x8, 0x7]
    codes = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.shape == (3, 5, 16)
    assert torch.equal(F.unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        F.pack_e2m1(u8([1, 2, 3]))


# ---------------------------------------------------------------------------------------------
# The NVFP4 group quantizer
# ---------------------------------------------------------------------------------------------


def test_nvfp4_group_with_max_6_is_exact_and_codes_are_hand_checked():
    x = [6.0, -3.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, -0.0, 0.5, -6.0, 4.0, 1.5, -2.0]
    packed, scales = F.nvfp4_quantize(f32([x]))
    assert scales.tolist() == [[0x38]]  # rn_e4m3(6 / 6) = 1.0
    codes = [0x7, 0xD, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8, 0x8, 0x1, 0xF, 0x6, 0x3, 0xC]
    assert packed.tolist() == [[codes[2 * i] | codes[2 * i + 1] << 4 for i in range(8)]]


def test_nvfp4_scale_rounding_can_saturate_codes():
    # amax / 6 = 1.06 rounds down to the scale 1.0, so 6.36 * 1 saturates to code 7 (6.0).
    packed, scales = F.nvfp4_quantize(f32([[6.36] + [0.0] * 15]))
    assert scales.tolist() == [[0x38]]
    assert F.unpack_e2m1(packed)[0, 0].item() == 0x7
    # amax / 6 = 1.07 rounds up to 1.125: 6.42 / 1.125 = 5.71 -> code 7 (6.0) without saturating
    packed, scales = F.nvfp4_quantize(f32([[6.42, -1.125] + [0.0] * 14]))
    assert scales.tolist() == [[0x39]]
    assert F.unpack_e2m1(packed)[0, :2].tolist() == [0x7, 0xA]


@pytest.mark.parametrize(
    "amax, scale_byte",
    [
        (6 * 2.0**-9, 0x01),  # smallest subnormal scale
        (6 * 3 * 2.0**-10, 0x02),  # tie 2^-9 | 2^-8 -> mantissa 2 (even)
        (6 * 2.0**-10, 0x00),  # tie 0 | 2^-9 -> 0: the whole group is zeroed
        (6 * 7 * 2.0**-9, 0x07),
        (0.0078125, 0x01),  # 2^-7 / 6 = 0.67 * 2^-9 -> 2^-9; 2^-7 * 512 = 4 -> code 6 (4.0)
        (3000.0, 0x7E),  # saturated scale
    ],
)
def test_nvfp4_subnormal_and_saturated_scales(amax, scale_byte):
    x = f32([[amax, -amax / 2] + [amax / 3] * 14])
    packed, scales = F.nvfp4_quantize(x)
    assert scales.item() == scale_byte
    s = F.e4m3_to_float(scales).item()
    codes = F.unpack_e2m1(packed)[0]
    if s == 0:
        assert codes.tolist() == [0] * 16
    else:
        r = torch.tensor(1.0 / s, dtype=torch.float32)  # FP64 quotient, rounded: correct
        want = F.rn_e2m1(F.mul_rn(x[0], r))
        assert torch.equal(codes, want)
    if amax == 0.0078125:
        assert codes[0].item() == 0x6


def test_nvfp4_zero_groups_have_zero_scale_and_zero_codes():
    # An all-zero group (with negative zeros) and a group too small for the smallest scale.
    x = f32([[0.0, -0.0] * 8, [-1e-4, 1e-4] * 8, [1.0] + [0.0] * 15])
    packed, scales = F.nvfp4_quantize(x)
    assert scales[:, 0].tolist() == [0, 0, 0x23]
    assert packed[:2].eq(0).all()  # no negative-zero codes
    assert F.nvfp4_dequantize(packed, scales)[:2].eq(0).all()


def test_nvfp4_quantize_against_scalar_spec_on_random_groups():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 48, generator=g) * torch.exp2(torch.randint(-12, 10, (64, 1), generator=g))
    packed, scales = F.nvfp4_quantize(x)
    assert packed.shape == (64, 24) and scales.shape == (64, 3)
    codes = F.unpack_e2m1(packed).tolist()
    for i in range(64):
        for grp in range(3):
            xs = x[i, 16 * grp : 16 * grp + 16].tolist()
            amax = max(abs(v) for v in xs)
            # SPEC: s = rn_e4m3(fp32(amax / 6)), r = fp32(1 / s), code = rn_e2m1(fp32(x * r)).
            s_byte = F.rn_e4m3(f32([amax]).double().div(6).float()).item()
            assert scales[i, grp].item() == s_byte
            s = F.e4m3_to_float(u8([s_byte])).item()
            for j, v in enumerate(xs):
                c = codes[i][16 * grp + j]
                if s == 0:
                    assert c == 0
                else:
                    r = torch.tensor(1.0 / s, dtype=torch.float64).float()
                    prod = (torch.tensor(v, dtype=torch.float64) * r.double()).float().item()
                    assert c == slow_e2m1(prod), (v, s, prod, c)


def test_nvfp4_dequantize_is_scale_times_code():
    x = torch.randn(5, 32)
    packed, scales = F.nvfp4_quantize(x)
    deq = F.nvfp4_dequantize(packed, scales)
    want = F.e2m1_to_float(F.unpack_e2m1(packed)) * F.e4m3_to_float(scales).repeat_interleave(
        16, dim=-1
    )
    assert torch.equal(deq, want)
    # Within the quantizer's error bound: half an E2M1 step of 1.0 at the group scale, plus the
    # saturation case (at most 6.4 / 6 of the scale's range).
    err = (deq - x).abs()
    bound = F.e4m3_to_float(scales).repeat_interleave(16, dim=-1) * 1.0 + 1e-6 * x.abs()
    assert (err <= bound).all()


def test_quantizers_reject_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 16"):
        F.nvfp4_quantize(torch.zeros(2, 17))
    with pytest.raises(ValueError, match="float32"):
        F.rn_e4m3(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="uint8"):
        F.e4m3_to_float(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError):
        F.rn_e2m1([1.0, 2.0])


# ---------------------------------------------------------------------------------------------
# The FP8 quantizer
# ---------------------------------------------------------------------------------------------


def test_fp8_quantize_hand_cases():
    x = f32([[1.0, -0.5, 0.0, -0.0], [0.0, 0.0, -0.0, 0.0], [448.0, 1.0, 2.0**-20, -3.0]])
    scale = F.fp8_scale(x.abs().amax(-1))
    assert scale[1].item() == 0.0
    assert scale[0].item() == torch.tensor(1 / 448, dtype=torch.float32).item()
    assert scale[2].item() == 1.0
    codes = F.fp8_quantize(x, scale.unsqueeze(-1))
    # Row 0: r = fp32(1 / fp32(1/448)) = 448 -> 448, -224, +0, -0.
    assert codes[0].tolist() == [0x7E, 0xF6, 0x00, 0x80]
    assert codes[1].tolist() == [0, 0, 0, 0]  # zero scale: all codes 0, no negative zero
    # Row 2: scale 1: 2^-20 is below half the smallest subnormal -> +0.
    assert codes[2].tolist() == [0x7E, 0x38, 0x00, 0xC4]


def test_fp8_scale_below_the_normal_range_is_zero():
    """SPEC 4.1: a scale below 2^-126 is 0 with its codes. Kept, fl(1 / s) of a scale below
    2^-128 is inf and 0 * inf made the group's zeros NaN codes (0xFF): a NaN output row."""
    amax = f32([448 * 2.0**-126, 448 * 2.0**-127, 1e-37, 448 * 2.0**-149, 0.0, 1.0])
    scale = F.fp8_scale(amax)
    assert scale[0].item() == 2.0**-126 and scale[5].item() > 0
    assert scale[1:5].eq(0).all()
    x = f32([[1e-37, 0.0, -0.0, -5e-38]])
    codes = F.fp8_quantize(x, F.fp8_scale(x.abs().amax(-1, keepdim=True)))
    assert codes.tolist() == [[0, 0, 0, 0]]
    # At the boundary the reciprocal is finite and the codes are the recipe's.
    y = f32([[448 * 2.0**-126, 0.0, -224 * 2.0**-126]])
    codes = F.fp8_quantize(y, F.fp8_scale(y.abs().amax(-1, keepdim=True)))
    assert codes.tolist() == [[0x7E, 0x00, 0xF6]]


def test_fp64_row_scales_of_the_fp8_q_quantizer_are_exact():
    """sm90/fp8_q_quantizer.cuh fp8_q_scale computes s = fl32(fl64(amax) * fl64(1/448)) and
    1 / s by two FP64 Newton steps from rcp.approx.f64, each rounded once to FP32, and claims
    both equal the pre-pass's __fdiv_rn(amax, 448) and __frcp_rn(s) for every BF16 amax. Checked
    here for all 32,640 finite non-negative BF16 values: the quotient exactly, the reciprocal from
    starting points off by up to 2^-14 relative in both directions (far worse than rcp.approx's)
    with the Newton steps as separately rounded FP64 operations (looser than the kernel's FMAs).
    The GPU test test_q_in_kernel_scales_on_every_bf16_magnitude checks the kernel itself."""
    bits = torch.arange(0x7F81, dtype=torch.int32)[:-1].to(torch.int16)  # +0 .. max finite
    amax = bits.view(torch.bfloat16).float()
    want = F.fp8_scale(amax)  # __fdiv_rn, then the SPEC 4.1 flush below 2^-126
    s = (amax.double() * (1.0 / 448.0)).float()
    s = torch.where(s < F.FP32_MIN_NORMAL, torch.zeros_like(s), s)
    assert torch.equal(s.view(torch.int32), want.view(torch.int32))
    d = want[want > 0].double()
    recip = (1.0 / d).float()  # fl32(fl64(1 / s)): correctly rounded (53 >= 2 * 24 + 2 bits)
    for start in (1 + 2.0**-14, 1 - 2.0**-14, 1 + 2.0**-22, 1 - 2.0**-22):
        y = (1.0 / d) * start
        for _ in range(2):
            y = y + y * (1.0 - d * y)
        assert torch.equal(y.float().view(torch.int32), recip.view(torch.int32)), start


def test_fp8_quantize_saturates_products_just_above_448():
    # amax * fp32(1 / fp32(amax / 448)) may round above 448: it must saturate, not become NaN.
    g = torch.Generator().manual_seed(3)
    amax = torch.rand(20000, generator=g) * 100 + 1e-3
    codes = F.fp8_quantize(amax, F.fp8_scale(amax))
    assert codes.eq(0x7E).all()


# ---------------------------------------------------------------------------------------------
# Value-only fast paths (used by the reference for P) agree with the coded paths
# ---------------------------------------------------------------------------------------------


def probe_values() -> torch.Tensor:
    """Ties and boundaries of both formats, every E4M3 value, and random values over many
    binades, with both signs."""
    g = torch.Generator().manual_seed(5)
    e4m3 = torch_e4m3_values()[:0x7F]
    quarters = torch.arange(0, 33, dtype=torch.float32) / 4  # E2M1 ties and grid points
    mid = (e4m3[:-1] + e4m3[1:]) / 2
    rnd = torch.randn(20000, generator=g) * torch.exp2(
        torch.randint(-16, 12, (20000,), generator=g).float())
    special = f32([0.0, 1e-30, 2.0**-10, 464.0, 1e6, math.inf])
    x = torch.cat([e4m3, mid, quarters, rnd, special])
    return torch.cat([x, -x])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_value_rounders_match_the_codes():
    x = probe_values()
    assert torch.equal(bits(F.round_e2m1(x)), bits(F.e2m1_to_float(F.rn_e2m1(x))))
    assert torch.equal(bits(F.round_e4m3(x)), bits(F.e4m3_to_float(F.rn_e4m3(x))))


def test_fake_quantize_matches_quantize_then_dequantize():
    x = probe_values()[: 16 * (probe_values().numel() // 16)].view(-1, 64)
    x = torch.cat([x, torch.zeros(1, 64), torch.full((1, 64), 1e-5), -torch.full((1, 64), 0.0)])
    want = F.nvfp4_dequantize(*F.nvfp4_quantize(x))
    assert torch.equal(bits(F.nvfp4_fake_quantize(x)), bits(want))


# ---------------------------------------------------------------------------------------------
# The CUDA twin (templates/include/numerics/formats.cuh), on a GPU
# ---------------------------------------------------------------------------------------------

PROBE_CU = r"""
// Test probe: runs the conversions of formats.cuh element by element so that the tests can
// compare them with flashinfer_h3/formats.py bit for bit.
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "numerics/formats.cuh"

namespace {
namespace fh = flashinfer_h3;
using tvm::ffi::TensorView;
constexpr int kThreads = 256;

__global__ void encode_kernel(const float* x, uint8_t* e4m3, uint8_t* e2m1_soft, uint8_t* e2m1x2,
                              int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  e4m3[i] = fh::e4m3_from_float(x[i]);
  e2m1_soft[i] = static_cast<uint8_t>(fh::e2m1_from_float_soft(x[i]));
  if (i % 2 == 0 && i + 1 < n) {
    e2m1x2[i / 2] = static_cast<uint8_t>(fh::e2m1x2_from_float(x[i], x[i + 1]));
  }
}

__global__ void decode_kernel(const uint8_t* b, float* e4m3, float* e2m1, float* half2, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  e4m3[i] = fh::e4m3_to_float(b[i]);
  e2m1[i] = fh::e2m1_to_float(b[i] & 0xFu);
  const __half2 h = fh::e2m1x2_to_half2(b[i]);
  half2[2 * i] = __low2float(h);
  half2[2 * i + 1] = __high2float(h);
}

__global__ void group_kernel(const float* x, uint8_t* codes, uint8_t* scales, int64_t groups) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  const float* xg = x + g * 16;
  float amax = 0.0f;
  for (int j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(xg[j]));
  const fh::Nvfp4Scale s = fh::nvfp4_scale_from_amax(amax);
  scales[g] = s.code;
  for (int j = 0; j < 8; ++j) {
    codes[g * 8 + j] = static_cast<uint8_t>(
        fh::e2m1x2_from_float(fh::nvfp4_scaled(xg[2 * j], s), fh::nvfp4_scaled(xg[2 * j + 1], s)));
  }
}

cudaStream_t stream_of(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t.device().device_id));
}

int blocks_for(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

void check_launch() {
  const cudaError_t err = cudaGetLastError();
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << cudaGetErrorString(err);
}

template <typename T>
T* ptr(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

void encode(TensorView x, TensorView e4m3, TensorView e2m1_soft, TensorView e2m1x2) {
  const int64_t n = x.size(0);
  if (n == 0) return;
  encode_kernel<<<blocks_for(n), kThreads, 0, stream_of(x)>>>(
      ptr<const float>(x), ptr<uint8_t>(e4m3), ptr<uint8_t>(e2m1_soft), ptr<uint8_t>(e2m1x2), n);
  check_launch();
}

void decode(TensorView b, TensorView e4m3, TensorView e2m1, TensorView half2) {
  const int64_t n = b.size(0);
  decode_kernel<<<blocks_for(n), kThreads, 0, stream_of(b)>>>(
      ptr<const uint8_t>(b), ptr<float>(e4m3), ptr<float>(e2m1), ptr<float>(half2), n);
  check_launch();
}

void quantize_groups(TensorView x, TensorView codes, TensorView scales) {
  const int64_t groups = x.size(0) / 16;
  group_kernel<<<blocks_for(groups), kThreads, 0, stream_of(x)>>>(
      ptr<const float>(x), ptr<uint8_t>(codes), ptr<uint8_t>(scales), groups);
  check_launch();
}
}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(encode, encode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode, decode);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_groups, quantize_groups);
"""


def build_probe(tmp_path, arch: str):
    """Compile PROBE_CU against formats.cuh for ``arch`` (e.g. sm_90a); returns the .so path."""
    import subprocess
    from pathlib import Path

    import tvm_ffi.libinfo

    from flashinfer_h3.jit import find_nvcc

    include = Path(__file__).resolve().parents[2] / "templates" / "include"
    src = tmp_path / "formats_probe.cu"
    src.write_text(PROBE_CU)
    so = tmp_path / f"formats_probe_{arch}.so"
    num = arch.removeprefix("sm_")
    cmd = [str(find_nvcc()), "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared",
           f"-gencode=arch=compute_{num},code={arch}", f"-I{include}",
           f"-I{tvm_ffi.libinfo.find_include_path()}",
           f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}", str(src), "-o", str(so)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return so


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_formats_match_formats_cuh_on_the_gpu(tmp_path):
    import tvm_ffi

    major, minor = torch.cuda.get_device_capability()
    mod = tvm_ffi.load_module(str(build_probe(tmp_path, f"sm_{major}{minor}a")))
    x = probe_values()
    x = x[: x.numel() // 16 * 16]
    xd = x.cuda()
    e4m3, soft = (torch.empty(x.numel(), dtype=torch.uint8, device="cuda") for _ in range(2))
    pairs = torch.empty(x.numel() // 2, dtype=torch.uint8, device="cuda")
    mod.encode(xd, e4m3, soft, pairs)
    assert torch.equal(e4m3.cpu(), F.rn_e4m3(x))
    assert torch.equal(soft.cpu(), F.rn_e2m1(x))
    assert torch.equal(pairs.cpu(), F.pack_e2m1(F.rn_e2m1(x)))  # native cvt on sm_120a

    b = all_e4m3_bytes()
    dec, dec2, half2 = (torch.empty(n, device="cuda") for n in (256, 256, 512))
    mod.decode(b.cuda(), dec, dec2, half2)
    finite = torch.ones(256, dtype=torch.bool)
    finite[[0x7F, 0xFF]] = False  # formats.cuh never meets them (it decodes 480); we give NaN
    assert torch.equal(bits(dec.cpu()[finite]), bits(F.e4m3_to_float(b)[finite]))
    assert torch.equal(bits(dec2.cpu()), bits(F.e2m1_to_float(b & 0xF)))
    assert torch.equal(bits(half2.cpu()), bits(F.e2m1_to_float(F.unpack_e2m1(b))))

    groups = torch.cat([x, torch.zeros(16), torch.full((16,), -1e-5), f32([6.36] + [0.0] * 15)])
    codes = torch.empty(groups.numel() // 2, dtype=torch.uint8, device="cuda")
    scales = torch.empty(groups.numel() // 16, dtype=torch.uint8, device="cuda")
    mod.quantize_groups(groups.cuda(), codes, scales)
    want_codes, want_scales = F.nvfp4_quantize(groups.view(-1, 16))
    assert torch.equal(scales.cpu(), want_scales.flatten())
    assert torch.equal(codes.cpu(), want_codes.flatten())
