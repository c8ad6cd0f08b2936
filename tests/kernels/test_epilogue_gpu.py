"""The attention epilogue's division (templates/include/attention/epilogue.cuh ``RowDivisor``: one
reciprocal a row, then three FFMAs a quotient) against IEEE division on the CPU (torch's float32
``x / d``), through the utils module's ``epilogue_divide``.

The Hopper FP8 kernel writes ``bf16_rn(fp32(O sv) / l)`` (SPEC 4.4) with it, where ``l`` is a row
sum of P: at least 256 (the row's maximum contributes 256) and finite. On that domain the quotient
must be the correctly rounded one bit for bit wherever it is a normal number and ``|x| >= 2^-100``,
within one unit of the last place below, and keep div.rn's special values (signed zeros, infinite
and NaN numerators)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_h3.jit import get_module

pytestmark = pytest.mark.gpu

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal number, 2^-126


@pytest.fixture(scope="module")
def utils():
    return get_module("utils")


def _floats(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) read as float32 bit patterns."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _random_floats(n: int, exp_lo: int, exp_hi: int, gen: torch.Generator) -> torch.Tensor:
    """n float32 values with uniformly random sign, mantissa bits and unbiased exponent in
    [exp_lo, exp_hi] (-127: the subnormals): every binade of that range equally often."""
    def draw(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64)

    sign, exponent, mantissa = draw(0, 2) << 31, draw(exp_lo + 127, exp_hi + 128), draw(0, 1 << 23)
    return _floats(sign | (exponent << 23) | mantissa)


def _row_sums(n: int, gen: torch.Generator) -> torch.Tensor:
    """Divisors as the kernels see them: 256 <= l <= 2^40, every binade; and every mantissa of
    one binade, [256, 512) (only the reciprocal depends on d's mantissa)."""
    binade_256 = torch.tensor(8 + 127, dtype=torch.int64) << 23
    every_mantissa = _floats(binade_256 | torch.arange(1 << 23))
    return torch.cat([_random_floats(n, 8, 39, gen).abs(), every_mantissa])


def _divide(utils, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, float("nan"), device="cuda")
    utils.epilogue_divide(x.cuda(), d.cuda(), out)
    torch.cuda.synchronize()
    return out.cpu()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("seed", [0, 1])
def test_quotients_are_correctly_rounded(utils, seed: int) -> None:
    gen = torch.Generator().manual_seed(20261206 + seed)
    d = _row_sums(1 << 22, gen)
    x = _random_floats(d.numel(), -100, 127, gen)
    want, got = x / d, _divide(utils, x, d)
    normal = want.abs() >= F32_TINY
    assert int(normal.sum()) > 0.9 * x.numel()  # the domain is not filtered away
    mismatch = normal & (_bits(got) != _bits(want))
    assert int(mismatch.sum()) == 0, (x[mismatch][:5].tolist(), d[mismatch][:5].tolist())


def test_tiny_values(utils) -> None:
    # Subnormal numerators and quotients near or below the smallest normal number: the same sign
    # and at most one unit of the last place away (the bit patterns of same-signed floats are
    # ordered like their magnitudes).
    gen = torch.Generator().manual_seed(7)
    d = _row_sums(1 << 20, gen)
    x = _random_floats(d.numel(), -127, -90, gen)
    want, got = x / d, _divide(utils, x, d)
    assert bool((_bits(got) < 0).eq(_bits(want) < 0).all())  # x's sign, -0 included
    ulps = (_bits(got).long() - _bits(want).long()).abs()
    assert int(ulps.max()) <= 1


def test_special_values(utils) -> None:
    # Zeros keep their sign, infinite numerators stay infinite, NaN stays NaN, FLT_MAX and exact
    # quotients are exact: div.rn's results bit for bit.
    values = [0.0, -0.0, 1.0, -1.0, 256.0, -512.0, 3.0, F32_MAX, -F32_MAX, 2.0**-100,
              float("inf"), float("-inf"), float("nan")]
    x = torch.tensor(values)
    for divisor in (256.0, 257.0, 1e6, 2.0**40):
        d = torch.full_like(x, divisor)
        got, want = _divide(utils, x, d), x / d
        assert torch.equal(_bits(got[:-1]), _bits(want[:-1])), divisor
        assert bool(got[-1].isnan()), divisor


def test_argument_errors(utils) -> None:
    x = torch.ones(8, device="cuda")
    with pytest.raises(ValueError, match="one size"):
        utils.epilogue_divide(x, torch.ones(7, device="cuda"), torch.empty_like(x))
    with pytest.raises(ValueError, match="float32"):
        utils.epilogue_divide(x.double(), x.double(), x.double())
    with pytest.raises(ValueError, match="CUDA"):
        utils.epilogue_divide(x.cpu(), x, x)
    empty = torch.empty(0, device="cuda")
    utils.epilogue_divide(empty, empty, empty)  # nothing to do
