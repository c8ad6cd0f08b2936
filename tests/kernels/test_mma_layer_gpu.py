"""GPU test of the block-scaled FP4 MMA layer (attention/mma_sync/mma_fp4_sm120.cuh native,
mma_fp4_sm90_emulated.cuh on Hopper).

The test-only module ``nvfp4_mma_probe`` (templates/mma_probe_nvfp4.cu.jinja, never part of the
production nvfp4 .so) exports ``mma_nvfp4_probe``, which runs one m16n8k64 product per warp for
every selector pair the attention kernel uses (thread-id-a in {0, 1} x thread-id-b in {0..3}). Each
warp builds its fragments from row-major matrices as the PTX ISA lays them out and puts the scale
words only in the lanes the selectors name; every other lane holds an E4M3 NaN (0x7F bytes), so a
layer that reads a scale from a wrong lane returns NaN, and one that uses a wrong byte or a wrong
code placement returns a wrong product. The products are compared with an FP64 torch matmul of the
dequantized operands (exact), within the FP32 accumulation error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashinfer_h3 import formats as F

pytestmark = pytest.mark.gpu

SELECTORS = [(ta, tb) for ta in (0, 1) for tb in range(4)]  # warp w: ta = w // 4, tb = w % 4
UE4M3_FINITE_MAX_CODE = 0x7E  # 448; 0x7F is NaN


@pytest.fixture(scope="module")
def module() -> Any:
    from flashinfer_h3.jit import get_module

    return get_module("nvfp4_mma_probe")


def _dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.nvfp4_dequantize(codes, scales).double()


def _probe(module: Any, a_codes, a_scales, b_codes, b_scales, c) -> torch.Tensor:
    d = torch.full((8, 16, 8), float("nan"), dtype=torch.float32, device="cuda")
    module.mma_nvfp4_probe(d, a_codes, a_scales, b_codes, b_scales, c)
    torch.cuda.synchronize()
    return d


def _check(d: torch.Tensor, a_codes, a_scales, b_codes, b_scales, c) -> None:
    a, b = _dequant(a_codes, a_scales), _dequant(b_codes, b_scales)
    want = a @ b.T + c.double()
    # FP32 accumulation of 64 exact products: error <= ~64 ulp of the sum of magnitudes.
    bound = 64 * 2.0**-23 * (a.abs() @ b.abs().T + c.double().abs()) + 1e-30
    assert torch.isfinite(d).all(), "NaN/inf: a scale was taken from a lane the selectors exclude"
    for w, (ta, tb) in enumerate(SELECTORS):
        err = (d[w].double() - want).abs()
        worst = (err / bound).max().item()
        assert worst <= 1.0, (
            f"thread-id-a={ta} thread-id-b={tb}: max |err| {err.max().item():.3e} is "
            f"{worst:.1f}x the FP32 accumulation bound"
        )


def _random_case(gen: torch.Generator, scale_hi: int) -> tuple[torch.Tensor, ...]:
    dev = "cuda"
    a_codes = torch.randint(0, 256, (16, 32), generator=gen, device=dev, dtype=torch.uint8)
    b_codes = torch.randint(0, 256, (8, 32), generator=gen, device=dev, dtype=torch.uint8)
    a_scales = torch.randint(0, scale_hi + 1, (16, 4), generator=gen, device=dev,
                             dtype=torch.uint8)
    b_scales = torch.randint(0, scale_hi + 1, (8, 4), generator=gen, device=dev,
                             dtype=torch.uint8)
    c = torch.randn(16, 8, generator=gen, device=dev) * 100
    return a_codes, a_scales, b_codes, b_scales, c


@pytest.mark.parametrize("scale_hi", [UE4M3_FINITE_MAX_CODE, 0x40, 0x08])
def test_random_codes_and_scales(module: Any, scale_hi: int) -> None:
    """Random codes (all 16 E2M1 values, both zeros) and UE4M3 scales: the full range up to 448,
    a normal-only range and subnormal scales (2^-9 .. 2^-6, where f16 must still be exact)."""
    gen = torch.Generator(device="cuda").manual_seed(1234 + scale_hi)
    for _ in range(16):
        case = _random_case(gen, scale_hi)
        _check(_probe(module, *case), *case)


def test_each_scale_byte_scales_its_own_k_range(module: Any) -> None:
    """One non-unit scale byte at a time: a layer that swaps bytes or K ranges fails here even
    when random data would average it out."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    a_codes, _, b_codes, _, c = _random_case(gen, UE4M3_FINITE_MAX_CODE)
    one = 0x38  # 1.0 in E4M3
    for operand in ("a", "b"):
        for byte in range(4):
            a_scales = torch.full((16, 4), one, dtype=torch.uint8, device="cuda")
            b_scales = torch.full((8, 4), one, dtype=torch.uint8, device="cuda")
            target = a_scales if operand == "a" else b_scales
            target[:, byte] = 0x60  # 32.0
            target[3, byte] = 0x00  # and one row/column with a zero scale there
            _check(_probe(module, a_codes, a_scales, b_codes, b_scales, c),
                   a_codes, a_scales, b_codes, b_scales, c)


def test_row_and_column_identity(module: Any) -> None:
    """Distinct scales per row of A and per column of B with all codes 1.0: D[m, n] is
    sum_j sa[m, j] sb[n, j] * 16, which pins every row to its SF_A lane and column to its SF_B
    lane."""
    codes_one = 0x22  # two E2M1 1.0 codes
    a_codes = torch.full((16, 32), codes_one, dtype=torch.uint8, device="cuda")
    b_codes = torch.full((8, 32), codes_one, dtype=torch.uint8, device="cuda")
    a_scales = (torch.arange(16 * 4, device="cuda").view(16, 4) % 0x50 + 0x20).to(torch.uint8)
    b_scales = (torch.arange(8 * 4, device="cuda").view(8, 4) * 3 % 0x50 + 0x18).to(torch.uint8)
    c = torch.zeros(16, 8, device="cuda")
    _check(_probe(module, a_codes, a_scales, b_codes, b_scales, c),
           a_codes, a_scales, b_codes, b_scales, c)
