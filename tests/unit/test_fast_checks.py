"""The fast path of the argument checks (diffusion_ops._well_formed) accepts exactly the calls the
full checks accept: any doubt sends a call through the full checks and their messages."""

from __future__ import annotations

import pytest
import torch

from flashinfer_h3 import diffusion_ops as ops


def test_cpu_tensors_take_the_full_checks() -> None:
    q = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    assert not ops._well_formed(q, q.clone(), q.clone(), cu, None)  # the full path says why


@pytest.mark.gpu
def test_fast_path_agrees_with_the_full_checks() -> None:
    dev = "cuda"

    def qkv(t=40, h=2, d=128, dtype=torch.bfloat16):
        return tuple(torch.zeros(t, h, d, dtype=dtype, device=dev) for _ in range(3))

    q, k, v = qkv()
    cu = torch.tensor([0, 40], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)
    assert ops._well_formed(q, k, v, cu, out) and ops._well_formed(q, k, v, cu, None)
    assert ops.check_tensors(q, k, v, cu, out) == (40, 2)
    bad = [
        (q.float(), k, v, cu, out), (q, k[:39], v, cu, out), (q, k, v[:, :1], cu, out),
        (q, k, v, cu.long(), out), (q, k, v, cu.view(1, 2), out), (q, k, v, cu.cpu(), out),
        (q, k, v, cu, out.float()), (q, k, v, cu, q), (q, k, v, cu, out[:, :1]),
        (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu, out),
        (qkv(d=64)[0], qkv(d=64)[1], qkv(d=64)[2], cu, None),
        (torch.nn.Parameter(q), k, v, cu, out),
    ]
    for args in bad:
        assert not ops._well_formed(*args)
