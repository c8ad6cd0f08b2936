"""GPU tests of the Hopper wgmma FP8 attention kernel (module ``fp8_wgmma``, sm_90a only).

The pre-pass and the case helpers are the mma.sync FP8 kernel's (both kernels read the same FP8
workspace, docs/spec.md section 4): every case runs the pre-pass into a poisoned workspace, the
kernel into a NaN-poisoned output with NaN guard rows behind it, and compares with the reference
emulation on the kernel's own workspace stages (relative L2 <= 0.02) and with the FP32 oracle
(docs/spec.md section 5 bars on Gaussian inputs at the default scale; elsewhere no worse than the
recipe itself). Execution properties: inputs and workspace unchanged, deterministic, a side
stream, CUDA-graph capture and replay on new inputs, the public operator's auto backend.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from test_attention_fp8_mma_sync_gpu import (
    DEFAULT_SCALE,
    REGIONS,
    Call,
    compare,
    prepare,
    slice_segments,
)
from test_attention_nvfp4_gpu import GUARD_ROWS, bounds_of, make_qkv

from flashinfer_h3 import reference as R

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def module() -> Any:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma FP8 kernel is a Hopper (compute capability 9.0) kernel")
    from flashinfer_h3.jit import get_module

    return get_module("fp8_wgmma")


def run_kernel(module: Any, call: Call, scale: float = DEFAULT_SCALE,
               out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        buf = torch.full((call.tokens + GUARD_ROWS, call.heads, 128), math.nan,
                         dtype=torch.bfloat16, device="cuda")
        out = buf[: call.tokens]
        out.guard = buf[call.tokens :]  # type: ignore[attr-defined]
    module.attention_fp8_wgmma(out, *call.kernel_args(), scale, call.host.vkey_start[-1])
    return out


def check(module: Any, lengths: list[int], heads: int, kind: str = "gauss", seed: int = 0,
          scale: float = DEFAULT_SCALE) -> None:
    bounds = bounds_of(lengths)
    q, k, v = make_qkv(bounds[-1], heads, kind, seed)
    before = [t.clone() for t in (q, k, v)]
    call = prepare(module, q, k, v, bounds)
    out = run_kernel(module, call, scale)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "non-finite output: a row was not written, or NaN leaked"
    assert out.guard.isnan().all(), "the kernel wrote past the last token"
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before, strict=True))
    ref = R.fp8_attention_from_stages(call.stages(), bounds, scale)
    oracle = R.attention_oracle(q, k, v, bounds, scale)
    shown = lengths if len(lengths) < 9 else f"{len(lengths)} segments"
    compare(out, ref, oracle, f"[wgmma] lengths={shown} H={heads} {kind} scale={scale:.4g}",
            kind == "gauss" and scale == DEFAULT_SCALE)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 127, 128, 129, 255, 257, 1000, 4095, 4097])
def test_single_segment(module: Any, length: int) -> None:
    check(module, [length], 2, seed=length)


def test_single_segment_16384(module: Any) -> None:
    check(module, [16384], 1, seed=16384)


PACKED = [[0, 5, 0, 295, 1, 1199, 0], [128, 129, 127, 64, 63, 65, 1, 0, 2], [17] * 40,
          [3000, 0, 0, 77]]


@pytest.mark.parametrize("lengths", PACKED, ids=lambda x: f"{len(x)}seg")
@pytest.mark.parametrize("heads", [1, 3])
def test_packed(module: Any, lengths: list[int], heads: int) -> None:
    check(module, lengths, heads, seed=len(lengths) * 10 + heads)


@pytest.mark.parametrize("heads", [2, 5, 14, 56])
def test_heads(module: Any, heads: int) -> None:
    check(module, [700, 0, 333, 7], heads, seed=heads)


@pytest.mark.parametrize("kind", ["biased", "heavy"])
def test_real_model_like_inputs(module: Any, kind: str) -> None:
    check(module, [300, 0, 1500, 9], 4, kind, seed=99)


@pytest.mark.parametrize("scale", [0.3, 0.02])
def test_softmax_scale(module: Any, scale: float) -> None:
    check(module, [600, 257], 2, seed=5, scale=scale)


def test_10000_short_segments(module: Any) -> None:
    rng = random.Random(10000)
    lengths = [rng.randint(0, 7) for _ in range(10000)]
    bounds = bounds_of(lengths)
    q, k, v = make_qkv(bounds[-1], 2, "gauss", 7)
    call = prepare(module, q, k, v, bounds)
    out = run_kernel(module, call)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and out.guard.isnan().all()
    for s0 in (0, 4850, 9700):
        sub, sub_bounds, t0, t1 = slice_segments(call, s0, s0 + 300)
        ref = R.fp8_attention_from_stages(sub, sub_bounds)
        oracle = R.attention_oracle(q[t0:t1], k[t0:t1], v[t0:t1], sub_bounds)
        compare(out[t0:t1], ref, oracle, f"[wgmma] 10000 segments, {s0}..{s0 + 299}", gauss=True)


def test_workspace_unchanged_deterministic_side_stream(module: Any) -> None:
    bounds = bounds_of([500, 0, 261])
    call = prepare(module, *make_qkv(bounds[-1], 3, "gauss", 11), bounds)
    torch.cuda.synchronize()
    before = {name: t.clone() for name, t in call.views.items()}
    first, second = run_kernel(module, call), run_kernel(module, call)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side = run_kernel(module, call)
    torch.cuda.synchronize()
    assert torch.isfinite(first).all() and torch.equal(first, second) and torch.equal(first, side)
    for name, t in call.views.items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name


def test_cuda_graph_capture_and_replay(module: Any) -> None:
    bounds = bounds_of([300, 129, 0, 64])
    q, k, v = make_qkv(bounds[-1], 2, "gauss", 21)
    call = prepare(module, q, k, v, bounds)
    eager = run_kernel(module, call)
    out = torch.empty_like(eager)

    def step() -> None:
        module.quantize_fp8(q, k, v, *call.tables, *(call.views[n] for n in REGIONS))
        run_kernel(module, call, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for dst, src in zip((q, k, v), make_qkv(q.shape[0], 2, "gauss", 22), strict=True):
        dst.copy_(src)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    fresh = run_kernel(module, prepare(module, q, k, v, call.bounds))
    torch.cuda.synchronize()
    assert torch.equal(out, fresh) and not torch.equal(out, eager)


def test_public_operator_auto_backend(module: Any) -> None:
    """On 9.0 the FP8 operator's auto backend is this kernel, through the whole call path."""
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
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err <= 0.02, err
