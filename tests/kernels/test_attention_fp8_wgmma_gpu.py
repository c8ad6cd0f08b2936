"""GPU tests of the Hopper wgmma FP8 attention kernel (module ``fp8_wgmma``, sm_90a only).

Both FP8 kernels read the same workspace (docs/spec.md section 4), so this file reruns the
kernel-independent cases of ``test_attention_fp8_mma_sync_gpu.py`` on this kernel: the
``module`` fixture below replaces that file's, and its ``run_kernel`` calls whichever attention
export the module has. Every case runs the pre-pass into a poisoned workspace and the kernel into
a NaN-poisoned output with guard rows, and compares with the reference emulation on the kernel's
own workspace stages (relative L2 <= 0.02) and with the FP32 oracle (docs/spec.md section 5 bars
on Gaussian inputs at the default scale). Shapes: empty, 1, 15-17, 63-65, 127-129, 1000,
4095/4097, 16,384 tokens, packed segments with empty ones, 10,000 segments of 0..7 tokens, 1-56
heads, biased and heavy-tailed inputs, two softmax scales; execution: workspace unchanged,
determinism, a side stream, CUDA-graph capture replayed on new inputs, no tokens. Added here:
the public operator's auto backend on 9.0 through the whole call path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention_fp8_mma_sync_gpu import (  # noqa: F401  (collected again, on this kernel)
    test_56_heads_multi_block,
    test_10000_short_segments,
    test_cuda_graph_capture_and_replay,
    test_heads,
    test_no_tokens_launches_nothing,
    test_packed,
    test_real_model_like_inputs,
    test_reference_operands,
    test_single_segment,
    test_single_segment_16384,
    test_softmax_scale,
    test_workspace_unchanged_deterministic_side_stream,
)
from test_attention_nvfp4_gpu import make_qkv, rel_l2

from flashinfer_h3 import reference as R

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def module() -> Any:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma FP8 kernel is a Hopper (compute capability 9.0) kernel")
    from flashinfer_h3.jit import get_module

    return get_module("fp8_wgmma")


def test_public_operator_auto_backend(module: Any) -> None:
    """On 9.0 the FP8 operator's auto backend is this kernel, through the whole call path, and
    agrees with the reference (and the mma.sync kernel, selected explicitly)."""
    from flashinfer_h3 import backends, varlen_attention_fp8

    dev = torch.device("cuda", torch.cuda.current_device())
    assert backends.resolve("fp8", torch.cuda.get_device_capability(dev)).name == "wgmma_fp8"
    bounds = [0, 700, 700, 1033]
    q, k, v = make_qkv(bounds[-1], 3, "gauss", 31)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    out = varlen_attention_fp8(q, k, v, cu, cu_seqlens_host=bounds)
    with backends.use_backend("fp8", "mma_sync_fp8"):
        other = varlen_attention_fp8(q, k, v, cu, cu_seqlens_host=bounds)
    ref = R.varlen_attention_fp8_reference(q, k, v, bounds)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    for got in (out, other):
        assert rel_l2(got, ref) <= 0.02
