"""Low-precision number formats of the NVFP4 and FP8 recipes, on torch tensors (CPU or CUDA).

This is the bit-exact twin of ``templates/include/formats.cuh`` (SPEC 3 and 4):

- E2M1 (FP4): code ``sign << 3 | i`` with magnitude ``E2M1_GRID[i]``. ``rn_e2m1`` rounds to the
  nearest grid value, ties to the even code, saturates to +-6; the sign is the float's sign bit,
  so ``-0.1`` encodes as ``0x8`` (negative zero), as the PTX ``cvt`` does.
- E4M3 (FP8, ``float8_e4m3fn`` bits) with sign, and UE4M3 (the same byte with sign 0, used for
  the NVFP4 scales): round to nearest even, subnormals kept (min ``2**-9``), saturated to +-448
  (``cvt.rn.satfinite``), never NaN. ``0x7F``/``0xFF`` (NaN in E4M3FN) are never produced and
  decode to NaN, so a kernel that writes them is caught.
- Packing: two E2M1 codes per byte, lower element in the low nibble.

Rounding of the FP32 steps the recipe fixes: products are plain FP32 multiplies (one IEEE
rounding; a lone multiply cannot be contracted into an FMA); quotients (``amax / 6``, ``1 / s``)
are evaluated in FP64 and rounded once to FP32, which equals the correctly rounded FP32 quotient
(FP64 has more than ``2 * 24 + 2`` bits) whatever a torch kernel does (some divide by a scalar
through its reciprocal).

Both encoders share one mechanism, ``_round_to_format``: round an FP32 magnitude to a few
mantissa bits with the integer round-half-even trick on its bit pattern, and to the subnormal
spacing below the smallest normal.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
GROUP = 16  # elements per NVFP4 scale
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_value(byte: int) -> float:
    """Exact value of an E4M3FN byte (NaN for 0x7F / 0xFF)."""
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 15 and man == 7:
        return float("nan")
    mag = man * 2.0**-9 if exp == 0 else (8 + man) * 2.0 ** (exp - 10)
    return -mag if byte & 0x80 else mag


_E4M3_VALUES = tuple(_e4m3_value(b) for b in range(256))
# Correctly rounded FP32 reciprocal of each E4M3 value (0 for zero, NaN for NaN): Python's 1/x is
# correctly rounded in FP64, and the FP64 -> FP32 step then rounds correctly (see module doc).
_E4M3_RECIPROCALS = tuple(1.0 / x if x != 0 else 0.0 for x in _E4M3_VALUES)
_E2M1_VALUES = E2M1_GRID + tuple(-x for x in E2M1_GRID)

_tables: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    t = _tables.get(key)
    if t is None:
        values = {"e4m3": _E4M3_VALUES, "e4m3_recip": _E4M3_RECIPROCALS,
                  "e2m1": _E2M1_VALUES}[name]
        t = torch.tensor(values, dtype=torch.float64).to(torch.float32).to(device)
        _tables[key] = t
    return t


def _check_float32(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {x.dtype}")


def _check_uint8(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.uint8:
        raise ValueError(f"{name} must be uint8, got {x.dtype}")


def _round_to_format(a: torch.Tensor, mantissa_bits: int, min_exp: int) -> torch.Tensor:
    """RN-even of FP32 magnitudes ``a`` (>= 0, finite, not above the format's max) to a float
    format with ``mantissa_bits`` and smallest normal ``2**min_exp`` (subnormals kept)."""
    drop = 23 - mantissa_bits
    bits = a.view(torch.int32)
    # Adding 0b0111..1 plus the lowest kept bit carries exactly when the dropped part is above
    # half, or equal to half with an odd kept part (ties to even); a carry may enter the exponent.
    rounded = (bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) >> drop << drop
    spacing = 2.0 ** (min_exp - mantissa_bits)  # subnormal step; a / spacing is exact
    sub = torch.round(a / spacing) * spacing  # torch.round: half to even
    return torch.where(a < 2.0**min_exp, sub, rounded.view(torch.float32))


# ---------------------------------------------------------------------------------------------
# FP32 steps with one correct rounding
# ---------------------------------------------------------------------------------------------


def mul_rn(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``a * b`` correctly rounded to FP32 (``__fmul_rn``); ``b`` must be exact in FP32."""
    return a.float() * (b.float() if isinstance(b, torch.Tensor) else b)


def div_rn(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` correctly rounded to FP32 (``__fdiv_rn``)."""
    b64 = b.double() if isinstance(b, torch.Tensor) else b
    return (a.double() / b64).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# E4M3 / UE4M3
# ---------------------------------------------------------------------------------------------


def rn_e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3FN bytes (uint8): RN-even, subnormals kept, saturated to +-448, sign bit kept.

    Matches ``cvt.rn.satfinite.e4m3x2.f32`` (infinities saturate too). NaN inputs are not part of
    the contract (they give 0x7F/0xFF).
    """
    _check_float32(x, "x")
    value = _round_to_format(x.abs().clamp(max=E4M3_MAX), 3, -6)  # clamp: satfinite
    # Normal: the top bits of the FP32 pattern, exponent rebiased from 127 to 7. Subnormal (and
    # 2**-6 reached by rounding up): the byte is value / 2**-9.
    normal = (value.view(torch.int32) >> 20) - ((127 - 7) << 3)
    mag = torch.where(value < 2.0**-6, (value * 512).to(torch.int32), normal).to(torch.uint8)
    mag = torch.where(torch.isnan(x), torch.full((), 0x7F, dtype=torch.uint8, device=x.device), mag)
    return mag | (torch.signbit(x).to(torch.uint8) << 7)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The FP32 value of ``rn_e4m3(x)`` (sign included), without the byte."""
    _check_float32(x, "x")
    return torch.copysign(_round_to_format(x.abs().clamp(max=E4M3_MAX), 3, -6), x)


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E4M3FN bytes -> exact FP32 values (0x7F/0xFF -> NaN, like torch.float8_e4m3fn)."""
    _check_uint8(codes, "codes")
    return _table("e4m3", codes.device)[codes.long()]


def rn_ue4m3(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> UE4M3 bytes: ``rn_e4m3`` of a non-negative value (x <= 0 and NaN give 0)."""
    _check_float32(x, "x")
    return rn_e4m3(torch.where(x > 0, x, torch.zeros((), dtype=x.dtype, device=x.device)))


ue4m3_to_float = e4m3_to_float


def e4m3_reciprocal(codes: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 ``1 / value`` of E4M3 bytes (0 for a zero code)."""
    _check_uint8(codes, "codes")
    return _table("e4m3_recip", codes.device)[codes.long()]


# ---------------------------------------------------------------------------------------------
# E2M1
# ---------------------------------------------------------------------------------------------


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The FP32 value of ``rn_e2m1(x)`` (sign included, -0.0 kept), without the code."""
    _check_float32(x, "x")
    return torch.copysign(_round_to_format(x.abs().clamp(max=E2M1_MAX), 1, 0), x)


def rn_e2m1(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E2M1 codes (uint8, 0..15): nearest grid value, ties to the even code, saturated
    to +-6, sign = the float's sign bit (so -0.0 and -0.1 give 0x8)."""
    _check_float32(x, "x")
    value = _round_to_format(x.abs().clamp(max=E2M1_MAX), 1, 0)
    # Below 1.0 the index is value / 0.5; from 1.0 on it is the FP32 pattern's exponent and top
    # mantissa bit, rebiased (1.0 -> 2, 1.5 -> 3, ... 6.0 -> 7).
    normal = (value.view(torch.int32) >> 22) - ((127 - 1) << 1)
    idx = torch.where(value < 1.0, (value * 2).to(torch.int32), normal).to(torch.uint8)
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> exact FP32 values."""
    _check_uint8(codes, "codes")
    return _table("e2m1", codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` codes -> ``[..., n]`` bytes, element ``2i`` in the low nibble."""
    _check_uint8(codes, "codes")
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]`` codes (low nibble first)."""
    _check_uint8(packed, "packed")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Group quantizers
# ---------------------------------------------------------------------------------------------


def _nvfp4_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x * r per group [..., n, 16], scale codes [..., n], scale values [..., n, 1])``."""
    _check_float32(x, "x")
    if x.shape[-1] % GROUP:
        raise ValueError(f"the last dimension must be a multiple of {GROUP}, got {x.shape[-1]}")
    g = x.unflatten(-1, (x.shape[-1] // GROUP, GROUP))
    scales = rn_e4m3(div_rn(g.abs().amax(dim=-1), E2M1_MAX))
    recip = e4m3_reciprocal(scales).unsqueeze(-1)
    # A zero scale maps the whole group to +0, so its codes are 0 (no negative zeros).
    scaled = torch.where(recip == 0, torch.zeros((), device=x.device), mul_rn(g, recip))
    return scaled, scales, e4m3_to_float(scales).unsqueeze(-1)


def nvfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 groups of 16 along the last dimension (SPEC 3, "quantize a group").

    ``s = rn_e4m3(amax / 6)``; a group with ``s == 0`` gets all codes 0; else ``r = 1 / s`` and
    ``code_i = rn_e2m1(x_i * r)``. Returns ``(packed codes [..., 8n] uint8, scales [..., n]
    uint8 UE4M3)`` for ``x`` of shape ``[..., 16n]`` (FP32).
    """
    scaled, scales, _ = _nvfp4_groups(x)
    return pack_e2m1(rn_e2m1(scaled).flatten(-2)), scales


def nvfp4_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """``nvfp4_dequantize(*nvfp4_quantize(x))`` without forming the codes (faster)."""
    scaled, _, scale_values = _nvfp4_groups(x)
    return (round_e2m1(scaled) * scale_values).flatten(-2)  # exact in FP32


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact FP32 values ``s * code`` of packed codes ``[..., 8n]`` with scales ``[..., n]``."""
    if packed.shape[-1] % (GROUP // 2):
        raise ValueError(f"packed codes must come in groups of {GROUP // 2} bytes, got "
                         f"{packed.shape[-1]}")
    values = e2m1_to_float(unpack_e2m1(packed))
    values = values.unflatten(-1, (values.shape[-1] // GROUP, GROUP))
    if values.shape[:-1] != scales.shape:
        raise ValueError(
            f"codes {tuple(packed.shape)} and scales {tuple(scales.shape)} do not match "
            f"(one scale per {GROUP} elements)"
        )
    return (values * ue4m3_to_float(scales).unsqueeze(-1)).flatten(-2)  # exact in FP32


FP32_MIN_NORMAL = 2.0**-126


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The FP8 recipe's FP32 scale ``amax / 448`` (not rounded to a format); 0 where that is
    below 2^-126 (SPEC 4.1: the reciprocal of a subnormal scale can overflow, and 0 * inf would
    make the group's zeros NaN codes)."""
    _check_float32(amax, "amax")
    s = div_rn(amax, E4M3_MAX)
    return torch.where(s < FP32_MIN_NORMAL, s.new_zeros(()), s)


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes ``rn_e4m3(x * (1 / scale))`` (SPEC 4); elements whose scale is 0 get code 0.

    ``scale`` broadcasts against ``x``; ``1 / scale`` and the product are correctly rounded FP32.
    """
    _check_float32(x, "x")
    _check_float32(scale, "scale")
    nonzero = scale != 0
    safe = torch.where(nonzero, scale, torch.ones((), device=scale.device))
    recip = div_rn(torch.ones((), device=scale.device), safe)
    codes = rn_e4m3(mul_rn(x, recip))
    return torch.where(nonzero, codes, torch.zeros((), dtype=torch.uint8, device=x.device))
