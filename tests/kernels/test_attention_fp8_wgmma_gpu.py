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
the public operator's auto backend on 9.0 through the whole call path, and the benchmark-only
builds of both Hopper kernels that change the schedule, not the arithmetic, against production.
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


def kernel_only_outputs(
    op: str, backend_name: str, modules: list[Any], bounds: tuple[int, ...]
) -> list[torch.Tensor]:
    """The attention kernel's output of each module (production first) on one 3-head Gaussian
    input, each after the production pre-pass (benchtools.KernelOnly, as the variant bench)."""
    from flashinfer_h3 import backends
    from flashinfer_h3.benchtools import KernelOnly

    backend = backends.get(op, backend_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v = make_qkv(bounds[-1], 3, "gauss", 7)
    outputs = []
    for mod in modules:
        prepared = backends.Prepared(backend, backend.make_launcher(mod, backend), dev)
        ko = KernelOnly(op, prepared, q, k, v, torch.empty_like(q), bounds, 128**-0.5)
        ko.prime()
        outputs.append(ko.run().clone())
    torch.cuda.synchronize()
    return outputs


def benchmark_build(module_name: str, flags: dict[str, Any]) -> Any:
    from pathlib import Path

    from flashinfer_h3.jit import KernelConfig, build_module
    from flashinfer_h3.jit.load import load_so

    return load_so(Path(build_module(KernelConfig(module_name, arch="sm_90a", flags=flags))))


BENCHMARK_BOUNDS = [(0, 1, 17, 17, 162, 300, 700, 1500), (0, 4097)]


@pytest.mark.parametrize(
    "flags",
    [{"stages": 3}, {"ping_pong": False}, {"wait_sleep_ns": 0}],
    ids=["ring-3", "no-ping-pong", "polling-waits"],
)
@pytest.mark.parametrize("bounds", BENCHMARK_BOUNDS, ids=["packed", "4097"])
def test_benchmark_builds_match_production(
    module: Any, flags: dict[str, Any], bounds: tuple[int, ...]
) -> None:
    """The benchmark-only builds that change the schedule but not the arithmetic
    (benchmarks/bench_wgmma_variants.py: a deeper ring, no ping-pong, the producer's waits
    polling) give the production build's output bit for bit. On segments of 1, 17, 162, ...
    tokens (single and partial tiles) and on one of 4,097 (33 tiles: both ring parities, a
    masked last tile)."""
    base, variant = kernel_only_outputs(
        "fp8", "wgmma_fp8", [module, benchmark_build("fp8_wgmma", flags)], bounds
    )
    assert torch.isfinite(base).all() and torch.isfinite(variant).all()
    assert torch.equal(base, variant)


@pytest.mark.parametrize("flags", [{"ping_pong": False}, {"wait_sleep_ns": 0}],
                         ids=["no-ping-pong", "polling-waits"])
@pytest.mark.parametrize("bounds", BENCHMARK_BOUNDS, ids=["packed", "4097"])
def test_nvfp4_benchmark_builds_match_production(
    flags: dict[str, Any], bounds: tuple[int, ...]
) -> None:
    """The NVFP4 kernel's benchmark-only builds that keep the arithmetic (no ping-pong; the
    producer warpgroup's waits polling) give the production build's output bit for bit."""
    from flashinfer_h3.jit import get_module

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma NVFP4 kernel is a Hopper (compute capability 9.0) kernel")
    base, variant = kernel_only_outputs(
        "nvfp4", "wgmma_fp16_nvfp4",
        [get_module("nvfp4_wgmma"), benchmark_build("nvfp4_wgmma", flags)], bounds,
    )
    assert torch.isfinite(base).all()
    assert torch.equal(base, variant)
