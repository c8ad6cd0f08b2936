"""The attention epilogue's division (templates/include/attention/epilogue.cuh ``RowDivisor``: one
reciprocal a row, then three FFMAs a quotient) against IEEE division (torch's float32 ``x / d`` on
the GPU, ``div.rn.f32``), through the utils module's ``epilogue_divide``.

Every attention kernel writes ``bf16_rn(fp32(O sv) / l)`` (SPEC 4.4) or ``bf16_rn(O / l)`` (SPEC
3.8), where ``l`` is a row sum of P: at least 256 (the row's maximum contributes 256) and finite.
On that domain the quotient must be the correctly rounded one, bit for bit, wherever it is a
normal number and ``|x| >= 2^-100``; below that it may be one subnormal unit away."""

from __future__ import annotations

import pytest
import torch

from flashinfer_h3.jit import get_module

pytestmark = pytest.mark.gpu

F32_MAX = torch.finfo(torch.float32).max


@pytest.fixture(scope="module")
def utils():
    return get_module("utils")


def _random_floats(n: int, exp_lo: int, exp_hi: int, gen: torch.Generator) -> torch.Tensor:
    """n float32 values with uniformly random sign, mantissa bits and unbiased exponent in
    [exp_lo, exp_hi]: every binade of that range equally often."""
    def draw(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, (n,), generator=gen, device="cuda", dtype=torch.int64)

    sign, exponent, mantissa = draw(0, 2) << 31, draw(exp_lo + 127, exp_hi + 128), draw(0, 1 << 23)
    bits = sign | (exponent << 23) | mantissa  # as unsigned 32-bit values
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _row_sums(n: int, gen: torch.Generator) -> torch.Tensor:
    """Divisors as the kernels see them: 256 <= l <= 2^40, every binade and mantissa."""
    d = _random_floats(n, 8, 39, gen).abs()
    return torch.cat([d, torch.tensor([256.0, 257.0, 384.0, 511.0, 1e6, 2.0**40], device="cuda")])


def _divide(utils, x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    utils.epilogue_divide(x, d, out)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_quotients_are_correctly_rounded(utils, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(20261206 + seed)
    d = _row_sums(1 << 22, gen)
    x = _random_floats(d.numel(), -100, 127, gen)
    want = x / d
    normal = want.abs() >= torch.finfo(torch.float32).tiny
    got = _divide(utils, x, d)
    assert not bool(got.isnan().any())
    assert int(normal.sum()) > 0.9 * x.numel()  # the domain is not filtered away
    mismatch = normal & (got.view(torch.int32) != want.view(torch.int32))
    assert int(mismatch.sum()) == 0, (x[mismatch][:5].tolist(), d[mismatch][:5].tolist())


def test_tiny_and_special_values(utils) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    # Quotients near and below the smallest normal, and numerators below 2^-100: within one
    # subnormal unit (the bit patterns of same-signed floats are ordered like their values).
    d = _row_sums(1 << 20, gen)
    x = _random_floats(d.numel(), -149 + 23, -90, gen)
    want, got = x / d, _divide(utils, x, d)
    ulps = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    same_sign = (got.view(torch.int32) < 0) == (want.view(torch.int32) < 0)
    assert bool(((ulps <= 1) & same_sign | (got == want)).all())
    # Zeros, the largest finite values and exact quotients.
    values = [0.0, -0.0, 1.0, -1.0, 256.0, -512.0, 3.0, F32_MAX, -F32_MAX, 2.0**-100]
    specials = torch.tensor(values, device="cuda")
    for divisor in (256.0, 257.0, 1e6, 2.0**40):
        dd = torch.full_like(specials, divisor)
        # torch.equal: +0 and -0 compare equal (x = -0 gives +0, see RowDivisor)
        assert torch.equal(_divide(utils, specials, dd), specials / dd), divisor


def test_argument_errors(utils) -> None:
    x = torch.ones(8, device="cuda")
    with pytest.raises(ValueError, match="one size"):
        utils.epilogue_divide(x, torch.ones(7, device="cuda"), torch.empty_like(x))
    with pytest.raises(ValueError, match="float32"):
        utils.epilogue_divide(x.double(), x.double(), x.double())
    empty = torch.empty(0, device="cuda")
    utils.epilogue_divide(empty, empty, empty)  # nothing to do
