"""GPU tests of the Hopper NVFP4 kernel's ``delta_wgmma=True`` and ``delta_wgmma_smem_a=True``
benchmark builds (Nvfp4Variant kDeltaOnWgmma: the delta products as ``wgmma m64n8k16`` by a fourth
warpgroup instead of mma.sync on three producer warps, A in registers or, kDeltaWgmmaSmemA, read
from shared memory; sm_90a only).

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
    bounds_of,
    layout_of,
    make_qkv,
    prepare,
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


# The build in both item orders (the dynamic one, production's, and static striding), and the
# build whose delta wgmmas read the K tile from shared memory (delta_wgmma_smem_a: SS, not RS).
@pytest.fixture(scope="module", params=[
    {"delta_wgmma": True},
    {"delta_wgmma": True, "dynamic_schedule": False},
    {"delta_wgmma_smem_a": True},
], ids=["dynamic", "static", "smem_a"])
def module(request: pytest.FixtureRequest) -> Any:
    return _build(request.param)


@pytest.mark.parametrize("lengths,heads,kind", [
    ([1, 129, 0, 700], 3, "gauss"), ([4097], 2, "gauss"), ([17] * 40, 5, "gauss"),
    ([1000, 537], 4, "biased"),
])
def test_matches_production(module: Any, lengths: list[int], heads: int, kind: str) -> None:
    """The same products, summed by the tensor core in another order: on the reference
    emulation such reorderings move the output by <= 7e-5 (rel L2), a wrong lo part or a
    misplaced half by >= 2.3e-3 on these shapes (6.4e-3 on biased inputs)."""
    production = _build({})
    bounds = bounds_of(lengths)
    qkv = make_qkv(bounds[-1], heads, kind, sum(lengths) + heads)
    prep = prepare(*qkv, bounds, layout_of(module))
    expected = run_kernel(production, prep)
    got = run_kernel(module, prep)
    assert torch.isfinite(got).all() and not got.guard.isfinite().any()
    diff = ((got.double() - expected.double()).norm() / expected.double().norm()).item()
    bar = 3e-4 if kind == "gauss" else 1e-3  # larger scores: more E2M1 ties of P move
    assert math.isfinite(diff) and diff <= bar, f"delta on wgmma vs mma.sync: rel L2 {diff:.2e}"
