"""The reference recipes and the oracle (flashinfer_h3.reference): hand-computed cases, the stage
layout, segment handling and an independent whole-segment emulation of both recipes.

Accuracy bars against the oracle and the speed checks live in test_reference_accuracy.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashinfer_h3 import formats as F
from flashinfer_h3 import reference as R
from flashinfer_h3.layout import fp8_layout, nvfp4_layout
from flashinfer_h3.plan import build_host_plan

D = 128


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def bounds_of(lengths: list[int]) -> list[int]:
    b = [0]
    for n in lengths:
        b.append(b[-1] + n)
    return b


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(bounds_of(lengths), dtype=torch.int32)


def qkv(tokens: int, heads: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(tokens, heads, D, generator=g) * scale).bfloat16() for _ in range(3))


def bf16_exact(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(t.bfloat16().float(), t), "test values must be exact in bf16"
    return t


# ---------------------------------------------------------------------------------------------
# An independent emulation: whole segment at once, full [H, L, L] score matrix, P quantized over
# the whole padded key row (so the 128-key tiles and the 16-key groups meet by index arithmetic
# written differently from the reference). Written from SPEC 3 / 4 and the rounding conventions
# of reference.py's module doc; small segments only.
# ---------------------------------------------------------------------------------------------


def r32(x: torch.Tensor) -> torch.Tensor:
    """One rounding of an FP64 value to FP32."""
    return x.to(torch.float32)


def dense_nvfp4(q, k, v, bounds, softmax_scale=None) -> torch.Tensor:
    c = R.log2_softmax_scale(softmax_scale)
    T, H, _ = q.shape
    out = torch.full((T, H, D), math.nan, dtype=torch.bfloat16)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        L = b - a
        if L == 0:
            continue
        qs, ks = (t[a:b].double().transpose(0, 1) for t in (q, k))  # [H, L, D]
        blk = torch.arange(L) // 128
        nb = int(blk[-1]) + 1
        kbar = r32(ks.sum(1, keepdim=True) / L)
        qbar = r32(torch.stack([qs[:, blk == g].mean(1) for g in range(nb)], 1))  # [H, nb, D]
        qh = F.nvfp4_dequantize(*F.nvfp4_quantize(r32(qs - qbar[:, blk].double()))).double()
        kh = F.nvfp4_dequantize(*F.nvfp4_quantize(r32(ks - kbar.double()))).double()
        lp = -(-L // 16) * 16
        vt = torch.zeros(H, D, lp)
        vt[:, :, :L] = v[a:b].float().permute(1, 2, 0)
        vh = F.nvfp4_dequantize(*F.nvfp4_quantize(vt)).transpose(1, 2).double()  # [H, lp, D]
        delta = r32(qbar.double() @ kh.transpose(1, 2))  # [H, nb, L]
        s = r32(qh @ kh.transpose(1, 2) + delta[:, blk].double())  # [H, L, L]
        m = torch.full((H, L), -math.inf)
        l_sum = torch.zeros(H, L)
        o = torch.zeros(H, L, D)
        for j0 in range(0, L, 128):
            keys = slice(j0, min(j0 + 128, L))
            mt = torch.maximum(m, s[..., keys].amax(-1))
            alpha = r32(torch.exp2(r32(r32(m.double() - mt.double()) * c).double()))
            e = r32(
                torch.exp2(r32(r32(s[..., keys].double() - mt[..., None].double()) * c).double())
            )
            p = r32(2688.0 * e.double())
            l_sum = r32(r32(alpha.double() * l_sum.double()) + p.double().sum(-1))
            row = torch.zeros(H, L, lp)
            row[..., keys] = p
            ph = F.nvfp4_dequantize(*F.nvfp4_quantize(row)).double()
            o = r32(r32(alpha[..., None].double() * o.double()) + r32(ph @ vh).double())
            m = mt
        out[a:b] = r32(o.double() / l_sum[..., None].double()).transpose(0, 1).bfloat16()
    return out


def flushed(s: torch.Tensor) -> torch.Tensor:
    """SPEC 4.1: an FP8 scale below 2^-126 is 0 (with its codes)."""
    return torch.where(s < 2.0**-126, torch.zeros_like(s), s)


def dense_fp8(q, k, v, bounds, softmax_scale=None) -> torch.Tensor:
    c = R.log2_softmax_scale(softmax_scale)
    T, H, _ = q.shape
    out = torch.full((T, H, D), math.nan, dtype=torch.bfloat16)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        L = b - a
        if L == 0:
            continue
        qf, vf = (t[a:b].float().transpose(0, 1) for t in (q, v))  # [H, L, D]
        ks = k[a:b].double().transpose(0, 1)
        kp = r32(ks - r32(ks.sum(1, keepdim=True) / L).double())
        sq = flushed(r32(qf.abs().amax(-1).double() / 448))  # [H, L]
        blk = torch.arange(L) // 128
        sk = torch.stack(
            [
                flushed(r32(kp[:, blk == g].abs().amax((1, 2)).double() / 448))
                for g in range(int(blk[-1]) + 1)
            ],
            1,
        )  # [H, nb]
        sv = flushed(r32(vf.abs().amax(1).double() / 448))  # [H, D]
        qv = F.e4m3_to_float(F.fp8_quantize(qf, sq[..., None])).double()
        kv = F.e4m3_to_float(F.fp8_quantize(kp, sk[:, blk, None])).double()
        vv = F.e4m3_to_float(F.fp8_quantize(vf, sv[:, None, :])).double()
        dot = r32(qv @ kv.transpose(1, 2))
        s = r32(r32(sq[:, :, None].double() * sk[:, None, blk].double()).double() * dot.double())
        m = torch.full((H, L), -math.inf)
        l_sum = torch.zeros(H, L)
        o = torch.zeros(H, L, D)
        for j0 in range(0, L, 128):
            keys = slice(j0, min(j0 + 128, L))
            mt = torch.maximum(m, s[..., keys].amax(-1))
            alpha = r32(torch.exp2(r32(r32(m.double() - mt.double()) * c).double()))
            e = r32(
                torch.exp2(r32(r32(s[..., keys].double() - mt[..., None].double()) * c).double())
            )
            p = r32(256.0 * e.double())
            l_sum = r32(r32(alpha.double() * l_sum.double()) + p.double().sum(-1))
            ph = F.e4m3_to_float(F.rn_e4m3(p)).double()
            o = r32(r32(alpha[..., None].double() * o.double()) + r32(ph @ vv[:, keys]).double())
            m = mt
        o = r32(r32(o.double() * sv[:, None, :].double()).double() / l_sum[..., None].double())
        out[a:b] = o.transpose(0, 1).bfloat16()
    return out


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    same = (a.view(torch.int16) == b.view(torch.int16)) if a.dtype == torch.bfloat16 else a == b
    if not bool(same.all()):
        idx = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int((~same).sum())} elements differ, first at {idx}")


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------

# v value -> NVFP4 output of a one-token segment, by hand: the only key gets Ptil = 2688,
# P scale 448 and code 6, so out = bf16(Vhat) with Vhat = s * code, s = rn_e4m3(|v| / 6):
#   1.0: 1/6 = 10.67 ulps of 2^-6 -> s = 11/64, code 6 (x*r = 5.82) -> 66/64 = 1.03125
#  -2.0: 1/3 -> s = 22/64 -> -2.0625;     3.0: s = 0.5 exactly -> 3.0
#   2^-7: 2^-7/6 = 0.67 * 2^-9 -> s = 2^-9 (subnormal), x*r = 4 -> code 4.0 -> 2^-7
#   2688: s = 448 (largest scale) -> 2688;   1e-4: amax/6 < 2^-10 -> s = 0 -> 0
ONE_TOKEN_NVFP4 = [
    (1.0, 1.03125),
    (-2.0, -2.0625),
    (3.0, 3.0),
    (0.0, 0.0),
    (2.0**-7, 2.0**-7),
    (2688.0, 2688.0),
    (-2688.0, -2688.0),
    (9.98e-5, 0.0),
]


def test_one_token_segments_nvfp4_by_hand():
    H, n = 2, 4
    vals = [x for x, _ in ONE_TOKEN_NVFP4]
    want = torch.tensor([w for _, w in ONE_TOKEN_NVFP4])
    q, k, _ = qkv(n, H, seed=1)
    v = torch.tensor(vals).repeat(D // len(vals)).bfloat16()  # channel c gets vals[c % 8]
    v = v.expand(n, H, D).contiguous()
    out = R.varlen_attention_nvfp4_reference(q, k, v, cu([1] * n))
    assert torch.equal(out.float(), want.repeat(D // len(vals)).expand(n, H, D))


def test_one_token_segments_fp8_return_v():
    # Ptil = 256 exactly, v's code is +-448 (x * r within an ulp of 448, saturated), so
    # out = bf16(256 * 448 * sv / 256) = v to well within half a bf16 ulp.
    H = 3
    q, k, v = qkv(7, H, seed=2, scale=3.0)
    v[2, 1, :8] = 0.0
    out = R.varlen_attention_fp8_reference(q, k, v, cu([1] * 7))
    assert_bitwise(out, v, "fp8 one-token segments")


@pytest.mark.parametrize("length", [16, 17, 129])
def test_identical_keys_give_the_mean_of_the_quantized_v(length):
    # K' = 0 (every key equals the mean), so every score is 0: Ptil = 2688 (NVFP4) / 256 (FP8)
    # for every key, each P group has scale 448 and code 6, and alpha = 1 on the second tile.
    # V: values of the E2M1 grid with a 6 in each 16-key group, so Vhat = v exactly.
    H = 2
    g = torch.Generator().manual_seed(length)
    grid = torch.tensor(F.E2M1_GRID)
    idx = torch.randint(0, 8, (length, H, D), generator=g)
    sign = torch.where(torch.rand(length, H, D, generator=g) < 0.5, -1.0, 1.0)
    vals = grid[idx] * sign
    vals[::16] = 6.0  # the first key of every group carries the max
    v = vals.bfloat16()
    q = torch.randn(length, H, D, generator=g).bfloat16()
    k = torch.randn(1, H, D, generator=g).bfloat16().expand(length, H, D).contiguous()
    bounds = cu([length])
    stages = R.nvfp4_quantize_stages(q, k, v, bounds)
    assert stages["k_codes"].eq(0).all() and stages["k_scales"].eq(0).all()
    out = R.varlen_attention_nvfp4_reference(q, k, v, bounds)
    want = (vals.double().sum(0) / length).float().bfloat16()  # fp32(sum / L), then bf16
    assert_bitwise(out, want.expand(length, H, D), "nvfp4 identical keys")

    # FP8: same scores; out = bf16(fp32(fp32(O * sv) / l)) with O = 256 * sum(vcode).
    out8 = R.varlen_attention_fp8_reference(q, k, v, bounds)
    sv = F.fp8_scale(vals.abs().amax(0))  # [H, D]
    vcode = F.e4m3_to_float(F.fp8_quantize(vals, sv)).double()
    o = (256.0 * vcode.sum(0)).float()
    want8 = ((o.double() * sv.double()).float().double() / (256.0 * length)).float().bfloat16()
    assert_bitwise(out8, want8.expand(length, H, D), "fp8 identical keys")


def test_stage_bytes_of_a_hand_built_group():
    # Two tokens k and -k: kbar = 0, so K' = k. V: 16 keys of channel 0 with max 6 -> scale 1.0.
    H = 1
    group = [
        6.0,
        -3.0,
        0.25,
        0.75,
        1.25,
        1.75,
        2.5,
        3.5,
        5.0,
        -0.125,
        -0.0,
        0.5,
        -6.0,
        4.0,
        1.5,
        -2.0,
    ]
    codes = [0x7, 0xD, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0x8, 0x8, 0x1, 0xF, 0x6, 0x3, 0xC]
    packed = [codes[2 * i] | codes[2 * i + 1] << 4 for i in range(8)]
    L = 16
    k = torch.zeros(L, H, D)
    k[0, 0, :16] = bf16_exact(group)
    k[1, 0, :16] = -bf16_exact(group)
    v = torch.zeros(L, H, D)
    v[:, 0, 0] = bf16_exact(group)
    q = torch.zeros(L, H, D)
    st = R.nvfp4_quantize_stages(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu([L]))
    assert st["kbar"].eq(0).all()
    assert st["k_codes"][0, 0, :8].tolist() == packed
    assert st["k_scales"][0, 0].tolist() == [0x38] + [0] * 7
    neg = [c ^ 8 for c in codes]  # -x: the same codes with the sign bit flipped
    assert F.unpack_e2m1(st["k_codes"][0, 1, :8]).tolist() == neg
    assert st["k_codes"][0, 2:].eq(0).all() and st["k_scales"][0, 2:].eq(0).all()
    # V transposed: row = channel 0, columns = keys; the segment is padded to 64 columns.
    assert st["v_codes"].shape == (H, D, 32) and st["v_scales"].shape == (H, D, 4)
    assert st["v_codes"][0, 0, :8].tolist() == packed
    assert st["v_scales"][0, 0].tolist() == [0x38, 0, 0, 0]
    assert st["v_codes"][0, 1:].eq(0).all() and st["v_codes"][0, 0, 8:].eq(0).all()
    # q = 0 everywhere: qbar = 0 and every q code and scale 0.
    assert st["qbar"].eq(0).all() and st["q_codes"].eq(0).all() and st["q_scales"].eq(0).all()


def test_q_block_means_and_smoothing_per_block():
    # 129 rows: block 0 = rows 0..127 (mean over 128), block 1 = row 128 alone, so its Q' is 0.
    H = 2
    q, k, v = qkv(129 + 40, H, seed=5)
    kbar, qbar = R.nvfp4_means(q, k, cu([129, 40]))
    assert qbar.shape == (3, H, D) and kbar.shape == (2, H, D)
    want = torch.stack([q[:128].double().mean(0), q[128].double(), q[129:].double().mean(0)])
    assert torch.equal(qbar, want.float())
    assert torch.equal(
        kbar, torch.stack([k[:129].double().mean(0), k[129:].double().mean(0)]).float()
    )
    st = R.nvfp4_quantize_stages(q, k, v, cu([129, 40]))
    assert st["q_codes"][:, 128].eq(0).all() and st["q_scales"][:, 128].eq(0).all()
    assert st["q_scales"][:, :128].ne(0).any()


def test_given_means_are_used_as_they_are():
    H = 2
    q, k, v = qkv(150, H, seed=6)
    bounds = cu([100, 50])
    kbar = torch.randn(2, H, D)
    qbar = torch.randn(2, H, D)
    st = R.nvfp4_quantize_stages(q, k, v, bounds, kbar=kbar, qbar=qbar)
    assert st["kbar"] is kbar and torch.equal(st["qbar"], qbar)
    want_codes, want_scales = F.nvfp4_quantize(
        ((k[:100].double() - kbar[0].double()).float()).transpose(0, 1).contiguous()
    )
    assert torch.equal(st["k_codes"][:, :100], want_codes)
    assert torch.equal(st["k_scales"][:, :100], want_scales)
    # A workspace-sized qbar (more rows than blocks) is accepted and cut.
    st2 = R.nvfp4_quantize_stages(
        q, k, v, bounds, kbar=kbar, qbar=torch.cat([qbar, torch.full((3, H, D), math.nan)])
    )
    assert torch.equal(st2["q_codes"], st["q_codes"]) and st2["qbar"].shape == (2, H, D)
    st8 = R.fp8_quantize_stages(q, k, v, bounds, kbar=kbar)
    assert st8["kbar"] is kbar


# ---------------------------------------------------------------------------------------------
# Against the independent emulation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[5], [16], [17], [128], [129], [300, 0, 17, 1, 5]])
def test_reference_matches_dense_emulation_bitwise(lengths):
    H = 3
    bounds = bounds_of(lengths)
    q, k, v = qkv(bounds[-1], H, seed=sum(lengths) + len(lengths))
    assert_bitwise(
        R.varlen_attention_nvfp4_reference(q, k, v, cu(lengths)),
        dense_nvfp4(q, k, v, bounds),
        f"nvfp4 {lengths}",
    )
    assert_bitwise(
        R.varlen_attention_fp8_reference(q, k, v, cu(lengths)),
        dense_fp8(q, k, v, bounds),
        f"fp8 {lengths}",
    )


def test_reference_matches_dense_emulation_with_tiny_groups():
    """Q rows, a segment's K and V channels of ~1e-37 (FP8 scales below 2^-126, flushed by SPEC
    4.1): the reference and the independent emulation agree bit for bit and are finite."""
    H, lengths = 2, [130, 0, 90]
    bounds = bounds_of(lengths)
    q, k, v = qkv(bounds[-1], H, seed=23)
    q[::5] *= 1e-37
    q[::5, :, ::3] = 0.0  # zeros in the tiny rows: NaN codes before the flush
    k[:130] *= 1e-37
    v[:, :, :8] *= 1e-37
    v[3, :, :8] = 0.0
    for fn, dense in ((R.varlen_attention_fp8_reference, dense_fp8),
                      (R.varlen_attention_nvfp4_reference, dense_nvfp4)):
        want = dense(q, k, v, bounds)
        assert torch.isfinite(want).all()
        assert_bitwise(fn(q, k, v, cu(lengths)), want, f"{fn.__name__} tiny groups")


def test_reference_matches_dense_emulation_with_a_softmax_scale_and_large_scores():
    H, lengths = 2, [140, 33]
    bounds = bounds_of(lengths)
    q, k, v = qkv(bounds[-1], H, seed=9, scale=4.0)
    for scale in (0.3, 0.01):
        assert_bitwise(
            R.varlen_attention_nvfp4_reference(q, k, v, cu(lengths), scale),
            dense_nvfp4(q, k, v, bounds, scale),
            f"nvfp4 scale {scale}",
        )
        assert_bitwise(
            R.varlen_attention_fp8_reference(q, k, v, cu(lengths), scale),
            dense_fp8(q, k, v, bounds, scale),
            f"fp8 scale {scale}",
        )


def test_query_and_key_chunking_do_not_change_results(monkeypatch):
    # Force query chunks of 128 rows and small oracle chunks: the results must not move.
    H, lengths = 2, [300, 129]
    q, k, v = qkv(sum(lengths), H, seed=10)
    want = [
        R.varlen_attention_nvfp4_reference(q, k, v, cu(lengths)),
        R.varlen_attention_fp8_reference(q, k, v, cu(lengths)),
        R.attention_oracle(q, k, v, cu(lengths)),
    ]
    monkeypatch.setattr(R, "_TILE_ELEMENTS", 1)
    monkeypatch.setattr(R, "_ORACLE_ELEMENTS", 1000)
    got = [
        R.varlen_attention_nvfp4_reference(q, k, v, cu(lengths)),
        R.varlen_attention_fp8_reference(q, k, v, cu(lengths)),
        R.attention_oracle(q, k, v, cu(lengths)),
    ]
    for g, w, what in zip(got, want, ("nvfp4", "fp8", "oracle"), strict=True):
        assert_bitwise(g, w, what)


# ---------------------------------------------------------------------------------------------
# Layout of the stages, workspace views
# ---------------------------------------------------------------------------------------------


def test_stage_shapes_follow_the_layout_with_real_counts():
    H, lengths = 3, [300, 0, 17, 1, 129]
    T, S = sum(lengths), len(lengths)
    plan = build_host_plan(bounds_of(lengths))
    q, k, v = qkv(T, H, seed=11)
    nqb, nv = plan.num_qblocks, plan.vkey_start[-1]
    assert (nqb, nv) == (3 + 1 + 1 + 2, 320 + 64 + 64 + 192)
    for op, layout, st in (
        ("nvfp4", nvfp4_layout(T, H, S), R.nvfp4_quantize_stages(q, k, v, cu(lengths))),
        ("fp8", fp8_layout(T, H, S), R.fp8_quantize_stages(q, k, v, cu(lengths))),
    ):
        assert set(st) == {r.name for r in layout.regions}, op
        for region in layout.regions:
            t = st[region.name]
            assert t.dtype == region.dtype and t.is_contiguous(), (op, region.name)
            want = list(region.shape)
            if region.name == "qbar":
                want[0] = nqb
            elif region.name == "k_scales" and op == "fp8":
                want[1] = nqb
            elif region.name.startswith("v_") and not (op == "fp8" and region.name == "v_scales"):
                want[2] = {"v_codes": nv // 2 if op == "nvfp4" else nv, "v_scales": nv // 16}[
                    region.name
                ]
            assert list(t.shape) == want, (op, region.name, t.shape, want)


def test_v_columns_follow_the_plan_and_padding_is_zero():
    H, lengths = 2, [70, 0, 5]
    plan = build_host_plan(bounds_of(lengths))
    q, k, v = qkv(75, H, seed=12)
    st = R.nvfp4_quantize_stages(q, k, v, cu(lengths))
    st8 = R.fp8_quantize_stages(q, k, v, cu(lengths))
    assert plan.vkey_start == (0, 128, 128, 192)
    codes = F.unpack_e2m1(st["v_codes"])  # [H, D, 192]
    scales = st["v_scales"]  # [H, D, 12]
    # Segment 0: keys 0..69 at columns 0..69; group 4 = keys 64..69 + 10 zero pads.
    want_c, want_s = F.nvfp4_quantize(
        torch.nn.functional.pad(v[:70].float().permute(1, 2, 0), (0, 10))
    )
    assert torch.equal(codes[..., :80], F.unpack_e2m1(want_c))
    assert torch.equal(scales[..., :5], want_s)
    assert codes[..., 80:128].eq(0).all() and scales[..., 5:8].eq(0).all()
    # Segment 2 (after the empty one) starts at column 128.
    want_c, want_s = F.nvfp4_quantize(
        torch.nn.functional.pad(v[70:].float().permute(1, 2, 0), (0, 11))
    )
    assert torch.equal(codes[..., 128:144], F.unpack_e2m1(want_c))
    assert torch.equal(scales[..., 8:9], want_s)
    assert codes[..., 144:].eq(0).all() and scales[..., 9:].eq(0).all()
    # FP8: keys permuted within each 16-key group (R.fp8_v_column); pads are code 0.
    order = R.fp8_v_key_order(64)  # key offset stored at each column of a 64-key chunk
    assert torch.equal(order[R.fp8_v_column(torch.arange(64))], torch.arange(64))
    assert order[:16].tolist() == [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    v8 = st8["v_codes"]
    scales8 = st8["v_scales"]  # [S, H, D]
    for s, (a, col0, n) in enumerate([(0, 0, 70), (70, 128, 5)]):
        cols = col0 + R.fp8_v_column(torch.arange(n))
        want = F.fp8_quantize(v[a:a + n].float(), scales8[2 * s]).permute(1, 2, 0)
        assert torch.equal(v8[..., cols], want)
        pad = torch.ones(v8.shape[-1], dtype=torch.bool)
        pad[cols] = False
        pad[:col0] = False
        pad[col0 + -(-n // 64) * 64:] = False
        assert v8[..., pad].eq(0).all()
    assert st8["v_scales"][1].eq(0).all() and st8["kbar"][1].eq(0).all()
    assert st["kbar"][1].eq(0).all()


def test_fp8_scales_per_token_block_and_segment_channel():
    H, lengths = 2, [130, 7]
    q, k, v = qkv(137, H, seed=13)
    st = R.fp8_quantize_stages(q, k, v, cu(lengths))
    assert torch.equal(st["q_scales"], F.fp8_scale(q.float().abs().amax(-1)).t())
    kp = (k.double() - st["kbar"].repeat_interleave(torch.tensor(lengths), 0).double()).float()
    blocks = [(0, 128), (128, 130), (130, 137)]
    want = torch.stack([F.fp8_scale(kp[a:b].abs().amax((0, 2))) for a, b in blocks], 1)
    assert torch.equal(st["k_scales"], want)
    assert torch.equal(
        st["v_scales"],
        torch.stack([F.fp8_scale(v[a:b].float().abs().amax(0)) for a, b in ((0, 130), (130, 137))]),
    )


@pytest.mark.parametrize(
    "fn", [R.varlen_attention_fp8_reference, R.varlen_attention_nvfp4_reference]
)
def test_tiny_rows_give_finite_outputs(fn):
    """Q rows, a whole segment's K and V channels of magnitude ~1e-37 (FP8 scales below 2^-126,
    flushed to 0 by SPEC 4.1: before, their zeros became NaN codes and the rows' outputs NaN).
    The outputs are finite and near the oracle's (FP8 0.044, NVFP4 0.16 here: a tiny Q row is
    quantised as Q' = -qbar after smoothing, whose E2M1 error is large against the row's own ~0
    scores)."""
    q, k, v = qkv(300, 2, seed=17)
    q[::7] *= 1e-37
    q[::7, :, ::3] = 0.0  # zeros in the tiny rows: NaN codes before the flush
    k[:100] *= 1e-37
    v[:100, :, :8] *= 1e-37
    bounds = cu([100, 200])
    out = fn(q, k, v, bounds)
    assert torch.isfinite(out).all()
    oracle = R.attention_oracle(q, k, v, bounds)
    bar = 0.08 if fn is R.varlen_attention_fp8_reference else 0.25
    assert ((out.float() - oracle).norm() / oracle.norm()).item() < bar


@pytest.mark.parametrize("op", ["nvfp4", "fp8"])
def test_attention_from_poisoned_workspace_views(op):
    # Stages copied into a workspace full of 0xFF (NaN floats, NaN scales, -6 codes): the
    # attention must read only the real part, and trim_stages must recover the stages exactly.
    H, lengths = 2, [150, 0, 20]
    T, S = sum(lengths), len(lengths)
    q, k, v = qkv(T, H, seed=14)
    layout = (nvfp4_layout if op == "nvfp4" else fp8_layout)(T, H, S)
    quantize = R.nvfp4_quantize_stages if op == "nvfp4" else R.fp8_quantize_stages
    attend = R.nvfp4_attention_from_stages if op == "nvfp4" else R.fp8_attention_from_stages
    st = quantize(q, k, v, cu(lengths))
    ws = torch.full((layout.total_bytes,), 0xFF, dtype=torch.uint8)
    views = layout.views(ws)
    for name, t in R.trim_stages(op, views, cu(lengths)).items():
        t.copy_(st[name])
    trimmed = R.trim_stages(op, views, cu(lengths))
    for name in st:
        assert torch.equal(trimmed[name], st[name]), name
    assert_bitwise(attend(views, cu(lengths)), attend(st, cu(lengths)), f"{op} from views")


# ---------------------------------------------------------------------------------------------
# Segments
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn", [R.varlen_attention_nvfp4_reference, R.varlen_attention_fp8_reference, R.attention_oracle]
)
def test_empty_segments_leave_no_trace(fn):
    H = 2
    q, k, v = qkv(150, H, seed=15)
    plain = fn(q, k, v, cu([5, 128, 17]))
    for lengths in ([0, 5, 128, 17], [5, 0, 0, 128, 17, 0], [5, 128, 0, 17]):
        assert_bitwise(fn(q, k, v, cu(lengths)), plain, f"{fn.__name__} {lengths}")


def test_empty_segments_in_stages():
    H = 2
    q, k, v = qkv(150, H, seed=16)
    a = R.nvfp4_quantize_stages(q, k, v, cu([5, 145]))
    b = R.nvfp4_quantize_stages(q, k, v, cu([5, 0, 145]))
    for name in a:
        if name == "kbar":
            assert torch.equal(b[name][[0, 2]], a[name]) and b[name][1].eq(0).all()
        else:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "fn", [R.varlen_attention_nvfp4_reference, R.varlen_attention_fp8_reference, R.attention_oracle]
)
def test_segments_are_independent(fn):
    H, lengths = 2, [100, 129, 40]
    q, k, v = qkv(269, H, seed=17)
    base = fn(q, k, v, cu(lengths))
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    g = torch.Generator().manual_seed(18)
    for t in (q2, k2, v2):
        t[100:229] = (torch.randn(129, H, D, generator=g) * 5 + 3).bfloat16()
    other = fn(q2, k2, v2, cu(lengths))
    assert_bitwise(other[:100], base[:100], "segment 0")
    assert_bitwise(other[229:], base[229:], "segment 2")
    assert not torch.equal(other[100:229], base[100:229])


def test_segments_match_separate_calls():
    H = 2
    q, k, v = qkv(190, H, seed=19)
    whole = R.varlen_attention_nvfp4_reference(q, k, v, cu([150, 40]))
    assert_bitwise(
        whole[:150],
        R.varlen_attention_nvfp4_reference(q[:150], k[:150], v[:150], cu([150])),
        "first",
    )
    assert_bitwise(
        whole[150:],
        R.varlen_attention_nvfp4_reference(q[150:], k[150:], v[150:], cu([40])),
        "second",
    )


def test_zero_tokens():
    H = 2
    e = torch.empty(0, H, D, dtype=torch.bfloat16)
    for bounds in ([0], [0, 0], [0, 0, 0]):
        c = torch.tensor(bounds, dtype=torch.int32)
        for fn in (R.varlen_attention_nvfp4_reference, R.varlen_attention_fp8_reference):
            assert fn(e, e, e, c).shape == (0, H, D)
        assert R.attention_oracle(e, e, e, c).shape == (0, H, D)
        st = R.nvfp4_quantize_stages(e, e, e, c)
        assert st["kbar"].shape == (len(bounds) - 1, H, D) and st["v_codes"].shape == (H, D, 0)


def test_cu_seqlens_forms_agree():
    H = 2
    q, k, v = qkv(40, H, seed=20)
    a = R.varlen_attention_nvfp4_reference(q, k, v, cu([30, 10]))
    b = R.varlen_attention_nvfp4_reference(q, k, v, [0, 30, 40])
    c = R.varlen_attention_nvfp4_reference(q, k, v, cu([30, 10]), cu_seqlens_host=[0, 30, 40])
    assert_bitwise(a, b, "list")
    assert_bitwise(a, c, "host")


# ---------------------------------------------------------------------------------------------
# The oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.2])
def test_oracle_against_sdpa_in_float64(scale):
    H, lengths = 3, [200, 1, 0, 37]
    q, k, v = qkv(sum(lengths), H, seed=21, scale=2.0)
    out = R.attention_oracle(q, k, v, cu(lengths), scale)
    assert out.dtype == torch.float32 and not out.isnan().any()
    for a, b in zip(bounds_of(lengths)[:-1], bounds_of(lengths)[1:], strict=True):
        if a == b:
            continue
        want = torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].double().transpose(0, 1) for t in (q, k, v)), scale=scale
        ).transpose(0, 1)
        torch.testing.assert_close(out[a:b], want.float(), rtol=2e-7, atol=1e-7)


def test_log2_softmax_scale_is_an_fp32_product():
    import numpy as np

    for s in (None, 0.125, 1 / 3, 0.07):
        ss = 1 / math.sqrt(128) if s is None else s
        assert R.log2_softmax_scale(s) == float(np.float32(ss) * np.float32(math.log2(math.e)))


# ---------------------------------------------------------------------------------------------
# Argument errors
# ---------------------------------------------------------------------------------------------


def test_argument_errors():
    H = 2
    q, k, v = qkv(10, H, seed=22)
    good = cu([10])
    ref = R.varlen_attention_nvfp4_reference
    with pytest.raises(ValueError, match="q must be torch.bfloat16"):
        ref(q.float(), k, v, good)
    with pytest.raises(ValueError, match="v .* does not match q"):
        ref(q, k, v[:9], good)
    with pytest.raises(ValueError, match="shape"):
        ref(q[..., :64], k[..., :64], v[..., :64], good)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        ref(q, "k", v, good)
    with pytest.raises(ValueError, match="int32"):
        ref(q, k, v, good.long())
    with pytest.raises(ValueError, match="start with 0"):
        ref(q, k, v, torch.tensor([1, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        ref(q, k, v, torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="number of tokens 10"):
        ref(q, k, v, torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_host"):
        ref(q, k, v, good, cu_seqlens_host=[0, 9])
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="softmax_scale"):
            ref(q, k, v, good, bad)
    for bad in ("0.1", True):
        with pytest.raises(TypeError, match="softmax_scale"):
            R.attention_oracle(q, k, v, good, bad)
    with pytest.raises(ValueError, match="kbar"):
        R.nvfp4_quantize_stages(q, k, v, good, kbar=torch.zeros(2, H, D))
    with pytest.raises(ValueError, match="qbar"):
        R.nvfp4_quantize_stages(q, k, v, good, qbar=torch.zeros(1, H, D, dtype=torch.float64))
    st = R.nvfp4_quantize_stages(q, k, v, good)
    del st["v_scales"]
    with pytest.raises(ValueError, match="v_scales"):
        R.nvfp4_attention_from_stages(st, good)
    st8 = R.fp8_quantize_stages(q, k, v, good)
    st8["k_scales"] = st8["k_scales"].double()
    with pytest.raises(ValueError, match="k_scales"):
        R.fp8_attention_from_stages(st8, good)
    with pytest.raises(ValueError, match="op must be"):
        R.trim_stages("fp4", st8, good)
