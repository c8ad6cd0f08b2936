"""flashinfer_h3.compat on a GPU: the adapters give exactly the operators' results, and the
attention a flash-attn / SageAttention caller expects (against an FP32 SDPA)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_h3 import diffusion_ops
from flashinfer_h3.compat import flash_attn_varlen_func, sageattn

pytestmark = pytest.mark.gpu

# SPEC 5 bars (relative L2 against the exact attention).
BARS = {"nvfp4": 0.21, "fp8": 0.06}


def _op(precision: str):
    return getattr(diffusion_ops, f"minimax_h3_sm120_varlen_attention_{precision}")


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _exact_dense_hnd(q, k, v, scale=None):
    """FP32 SDPA of [B, H, N, D] inputs (the math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), scale=scale
        )


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_flash_attn_varlen_equals_the_operator(precision: str) -> None:
    torch.manual_seed(0)
    lengths = [300, 0, 181, 17]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, k, v = (torch.randn(bounds[-1], 3, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    want = _op(precision)(q, k, v, cu, cu_seqlens_host=bounds, softmax_scale=0.07)
    got = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), 0.0, 0.07,
                                 precision=precision)
    got_host = flash_attn_varlen_func(q, k, v, cu, cu.clone(), 300, 300, softmax_scale=0.07,
                                      precision=precision, cu_seqlens_host=bounds)
    assert torch.equal(got, want) and torch.equal(got_host, want)


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_flash_attn_varlen_on_a_packed_qkv_slice(precision: str) -> None:
    torch.manual_seed(1)
    qkv = torch.randn(256, 3, 2, 128, device="cuda", dtype=torch.bfloat16)
    before = qkv.clone()
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    got = flash_attn_varlen_func(q, k, v, cu, cu, 156, 156, precision=precision)
    want = _op(precision)(q.contiguous(), k.contiguous(), v.contiguous(), cu)
    assert torch.equal(got, want) and torch.equal(qkv, before)


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_sageattn_equals_the_operator_and_is_attention(precision: str, layout: str) -> None:
    torch.manual_seed(2)
    b, h, n = 2, 3, 200
    hnd = [torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    inputs = hnd if layout == "HND" else [t.transpose(1, 2).contiguous() for t in hnd]
    before = [t.clone() for t in inputs]
    out = sageattn(*inputs, tensor_layout=layout, sm_scale=0.09, precision=precision)
    assert out.shape == inputs[0].shape and out.dtype == torch.bfloat16
    assert all(torch.equal(a, c) for a, c in zip(inputs, before, strict=True))

    packed = [t.transpose(1, 2).reshape(b * n, h, 128) for t in hnd]
    bounds = [i * n for i in range(b + 1)]
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    want = _op(precision)(*packed, cu, cu_seqlens_host=bounds, softmax_scale=0.09)
    out_nhd = out.transpose(1, 2) if layout == "HND" else out
    assert torch.equal(out_nhd.reshape(b * n, h, 128), want)

    exact = _exact_dense_hnd(*hnd, scale=0.09)
    out_hnd = out if layout == "HND" else out.transpose(1, 2)
    assert _rel_l2(out_hnd, exact) <= BARS[precision]
