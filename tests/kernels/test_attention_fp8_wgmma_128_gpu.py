"""GPU tests of the Hopper wgmma FP8 kernel built with 128-key KV tiles (``tile_keys=128``, with
its exponential split ``poly_exp2_every=32``: production until 2026-12-02; production now takes
256-key tiles).

The same kernel-independent cases as ``test_attention_fp8_wgmma_gpu.py`` (empty, 1, 15-17,
63-65, 127-129, 1000, 4095/4097, 16,384 tokens, packed and 10,000 tiny segments, 1-56 heads,
biased and heavy-tailed inputs, two softmax scales, graphs, streams, an unchanged workspace),
each against the reference emulation on the kernel's own workspace (relative L2 <= 0.02) and the
FP32 oracle's bars. Added: production's 256-key tiles are as accurate against the oracle as this
build.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_attention_fp8_mma_sync_gpu import (  # noqa: F401  (collected again, on this build)
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
from test_attention_fp8_wgmma_gpu import (
    BENCHMARK_BOUNDS,
    BENCHMARK_IDS,
    benchmark_build,
    kernel_only_outputs,
)
from test_attention_nvfp4_gpu import make_qkv, rel_l2

pytestmark = pytest.mark.gpu

FLAGS = {"tile_keys": 128, "poly_exp2_every": 32}


@pytest.fixture(scope="module")
def module() -> Any:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma FP8 kernel is a Hopper (compute capability 9.0) kernel")
    return benchmark_build("fp8_wgmma", FLAGS)


@pytest.mark.parametrize("bounds", BENCHMARK_BOUNDS + [(0, 385), (0, 129, 514)],
                         ids=BENCHMARK_IDS + ["385", "129-385"])
def test_256_key_tiles_as_accurate(module: Any, bounds: tuple[int, ...]) -> None:
    """Against the FP32 oracle, production (256-key tiles) is no less accurate than this build.
    The two differ by more than rounding (up to ~1 % rel L2 on short segments): wherever the max
    over 256 keys exceeds the one over a tile's first 128, that half's P = 256 2^((S - m) c)
    lands on another E4M3 grid, so its rounding errors are drawn afresh."""
    from flashinfer_h3 import reference as R
    from flashinfer_h3.jit import get_module

    got, base = kernel_only_outputs("fp8", "wgmma_fp8", [get_module("fp8_wgmma"), module], bounds)
    q, k, v = make_qkv(bounds[-1], 3, "gauss", 7)  # kernel_only_outputs' inputs
    oracle = R.attention_oracle(q, k, v, list(bounds), 128**-0.5)
    assert torch.isfinite(got).all()
    err_got, err_base = rel_l2(got, oracle), rel_l2(base, oracle)
    print(f"256-key tiles {bounds}: rel L2 vs oracle {err_got:.4f} (128-key: {err_base:.4f}), "
          f"vs 128-key {rel_l2(got, base):.4f}")
    assert err_got <= 1.05 * err_base
    assert rel_l2(got, base) <= 0.02
