"""GPU tests of the Hopper NVFP4 kernel's ``delta_wgmma=True`` benchmark build (Nvfp4Variant
kDeltaOnWgmma: the delta products as ``wgmma m64n8k16`` by a fourth warpgroup instead of
mma.sync on three producer warps; sm_90a only).

The build is not production, but its output is attention and is measured against production
(benchmarks/bench_wgmma_variants.py, bench_energy.py), so it must be right first: this file reruns
the kernel cases of ``test_attention_nvfp4_gpu.py`` on it (the ``module`` fixture below replaces
that file's, as ``test_attention_nvfp4_wgmma_gpu.py`` does for production: relative L2 <= 0.02
against the reference emulation, SPEC 5's bars, poisoned outputs and workspace, packed segments
with empty ones, 1-56 heads, determinism, a side stream, graph replay), and compares it with the
production build on the same operands: the products are the same exact FP16 x FP16 terms, only
the tensor core's FP32 summation order may differ, so the outputs agree to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_attention_nvfp4_gpu import (  # noqa: F401  (collected again, on this build)
    _prepared,
    run_kernel,
    test_56_heads,
    test_cuda_graph_capture_and_replay,
    test_deterministic_and_side_stream,
    test_packed,
    test_real_model_like_inputs,
    test_single_segment,
    test_softmax_scale,
)

pytestmark = pytest.mark.gpu


def _build(flags: dict[str, Any]) -> Any:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma NVFP4 kernel is a Hopper (compute capability 9.0) kernel")
    from flashinfer_h3.jit import KernelConfig, build_module
    from flashinfer_h3.jit.load import load_so

    return load_so(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a", flags=flags)))


@pytest.fixture(scope="module")
def module() -> Any:
    return _build({"delta_wgmma": True})


@pytest.mark.parametrize("lengths,heads", [([1, 129, 0, 700], 3), ([4097], 2), ([17] * 40, 5)])
def test_matches_production(module: Any, lengths: list[int], heads: int) -> None:
    production = _build({})
    prep = _prepared(production, lengths, heads, seed=sum(lengths) + heads)
    expected = run_kernel(production, prep)
    got = run_kernel(module, prep)
    assert torch.isfinite(got).all() and not got.guard.isfinite().any()
    diff = ((got.double() - expected.double()).norm() / expected.double().norm()).item()
    assert diff <= 1e-3, f"delta on wgmma vs mma.sync: rel L2 {diff:.2e}"
    assert math.isfinite(diff)
