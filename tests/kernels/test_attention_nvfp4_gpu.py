"""GPU tests of the NVFP4 attention kernel (``attention_nvfp4`` of the nvfp4 module).

The kernel is fed the reference's own quantized operands (``reference.nvfp4_quantize_stages``;
for the Hopper kernel, which reruns these cases, the same operands as FP16 values,
``reference.nvfp4_fp16_operands``) copied into a workspace laid out by ``layout.py``, so these
tests exercise the attention kernel alone, independent of the quantization pre-pass. Every byte
of the workspace the copy does not fill holds 0x7F (a NaN UE4M3 scale, +-6 codes, a huge float),
and the output starts as NaN, so a kernel that reads an unused byte or forgets a row cannot
pass.

Per case: every output element finite and no byte of ``out`` past the tokens touched; relative L2
against the reference emulation fed the same operands (``reference.nvfp4_attention_from_stages``)
<= 0.02. Against the FP32 oracle: SPEC 5's bars (allclose atol 1.0 rtol 0.1, cosine >= 0.975,
relative L2 <= 0.21) on Gaussian inputs at the default softmax scale; on the other inputs (biased
or heavy-tailed q/k, a 3.4x larger scale) the recipe itself is further from the oracle (measured
on an H200: the reference emulation's cosine drops to ~0.86-0.97), so there the kernel must be
within 0.005 (relative L2) and 0.002 (cosine) of the reference emulation's own oracle error.
Also: determinism, a non-default stream, CUDA graph capture and replay, tokens == 0, and the
binding's argument checks. On an SM90 GPU this runs the kernel with the emulated MMA layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from flashinfer_h3 import reference as R
from flashinfer_h3.layout import WorkspaceLayout, nvfp4_fp16_layout, nvfp4_layout
from flashinfer_h3.plan import build_host_plan

pytestmark = pytest.mark.gpu

POISON = 0x7F
REF_REL_L2 = 0.02
ORACLE_REL_L2 = 0.21
ORACLE_COS = 0.975
ORACLE_ATOL, ORACLE_RTOL = 1.0, 0.1
DEFAULT_SCALE = 1.0 / math.sqrt(128)


@pytest.fixture(scope="module")
def module() -> Any:
    from flashinfer_h3.jit import get_module

    return get_module("nvfp4")


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def make_qkv(tokens: int, heads: int, kind: str, seed: int) -> tuple[torch.Tensor, ...]:
    """``gauss``: N(0, 1). ``biased``: q and k get a per-channel bias with a few large outlier
    channels (real DiT activations). ``heavy``: per-token magnitudes spread over decades.
    ``tiny``: some Q rows, the first third of the keys and 8 V channels of magnitude ~1e-37
    (FP8 scales below 2^-126, which SPEC 4.1 flushes to 0: NaN rows before)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    q, k, v = (randn(tokens, heads, 128) for _ in range(3))
    if kind == "biased":
        for x in (q, k):
            bias = randn(1, heads, 128) * 2.0
            bias[..., :4] *= 8.0  # outlier channels
            x += bias
    elif kind == "heavy":
        q *= torch.exp(randn(tokens, heads, 1) * 1.5)
        k *= torch.exp(randn(tokens, heads, 1) * 1.5)
    elif kind == "tiny":
        q[::7] *= 1e-37
        k[: tokens // 3] *= 1e-37
        v[:, :, :8] *= 1e-37
    elif kind != "gauss":
        raise ValueError(kind)
    return tuple(x.to(torch.bfloat16).contiguous() for x in (q, k, v))


def bounds_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# ---------------------------------------------------------------------------------------------
# One prepared call: plan tables and a poisoned workspace holding the reference's operands
# ---------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    tokens: int
    heads: int
    bounds: list[int]
    stages: dict[str, torch.Tensor]
    views: dict[str, torch.Tensor]
    tables: dict[str, torch.Tensor]

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        v = self.views
        t = self.tables
        return (v["qbar"], v["q_codes"], v["q_scales"], v["k_codes"], v["k_scales"],
                v["v_codes"], v["v_scales"], t["seg_bounds"], t["vkey_start"], t["qblocks"])


def device_tables(bounds: list[int]) -> dict[str, torch.Tensor]:
    host = build_host_plan(bounds)
    blocks = [x for blk in host.qblocks for x in blk]
    i32 = dict(dtype=torch.int32, device="cuda")
    return {
        "seg_bounds": torch.tensor(host.bounds, **i32),
        "vkey_start": torch.tensor(host.vkey_start, **i32),
        "qblock_start": torch.tensor(host.qblock_start, **i32),
        "qblocks": torch.tensor(blocks, **i32).view(host.num_qblocks, 4),
    }


def is_wgmma(module: Any) -> bool:
    """The Hopper kernel's module (test_attention_nvfp4_wgmma_gpu.py reruns this file on it)."""
    return hasattr(module, "attention_nvfp4_wgmma")


def layout_of(module: Any) -> Callable[[int, int, int], WorkspaceLayout]:
    """The workspace layout the module's kernel reads (the wgmma kernel's adds FP16 operands)."""
    return nvfp4_fp16_layout if is_wgmma(module) else nvfp4_layout


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
            layout_fn: Callable[[int, int, int], WorkspaceLayout] = nvfp4_layout) -> Prepared:
    T, H, _ = q.shape
    stages = R.nvfp4_quantize_stages(q, k, v, bounds)
    layout = layout_fn(T, H, len(bounds) - 1)
    if layout.op == "nvfp4_fp16":  # the Hopper kernel reads the operands as FP16 values
        stages.update(R.nvfp4_fp16_operands(stages, bounds))
    ws = torch.full((layout.total_bytes,), POISON, dtype=torch.uint8, device="cuda")
    views = layout.views(ws)
    fill_workspace(views, stages)
    return Prepared(T, H, bounds, stages, views, device_tables(bounds))


def fill_workspace(views: dict[str, torch.Tensor], stages: dict[str, torch.Tensor]) -> None:
    """The reference's operands into the layout's views: each stage the layout has, into the
    leading part of its region (only the parts a call uses: qbar rows past NQB, V columns and
    FP16 K rows past ``vkey_start[S]`` keep the poison)."""
    for name, stage in stages.items():
        if name in views:
            views[name][tuple(slice(0, n) for n in stage.shape)].copy_(stage)


GUARD_ROWS = 8  # rows of NaN after ``out`` in the same allocation: must stay untouched


def run_kernel(module: Any, prep: Prepared, scale: float = DEFAULT_SCALE,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's output; a fresh one is NaN-poisoned with NaN guard rows behind it."""
    if out is None:
        buf = torch.full((prep.tokens + GUARD_ROWS, prep.heads, 128), math.nan,
                         dtype=torch.bfloat16, device="cuda")
        out = buf[: prep.tokens]
        out.guard = buf[prep.tokens :]  # type: ignore[attr-defined]
    if is_wgmma(module):
        # The Hopper kernel on the reference's operands as FP16 values (prepare).
        v, t = prep.views, prep.tables
        used = build_host_plan(prep.bounds).vkey_start[-1]
        fp16 = (v["q_f16"], v["k_f16"], v["v_f16"])
        module.attention_nvfp4_wgmma(out, v["qbar"], *fp16, t["seg_bounds"], t["vkey_start"],
                                     t["qblock_start"], t["qblocks"], v["item_counter"], scale,
                                     used)
    else:
        module.attention_nvfp4(out, *prep.kernel_args(), scale)
    return out


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def cosine(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().flatten(), ref.double().flatten()
    return (x @ ref / (x.norm() * ref.norm()).clamp_min(1e-30)).item()


def check_case(module: Any, lengths: list[int], heads: int, kind: str, seed: int,
               scale: float = DEFAULT_SCALE) -> None:
    bounds = bounds_of(lengths)
    q, k, v = make_qkv(bounds[-1], heads, kind, seed)
    prep = prepare(q, k, v, bounds, layout_of(module))
    out = run_kernel(module, prep, scale)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "non-finite output: a row was not written, or NaN leaked"
    assert out.guard.isnan().all(), "the kernel wrote past the last token"

    ref = R.nvfp4_attention_from_stages(prep.stages, bounds, scale)
    oracle = R.attention_oracle(q, k, v, bounds, scale)
    e_ref, e_or, cos = rel_l2(out, ref), rel_l2(out, oracle), cosine(out, oracle)
    recipe_e, recipe_cos = rel_l2(ref, oracle), cosine(ref, oracle)
    print(f"[nvfp4 attn] lengths={lengths if len(lengths) < 9 else len(lengths)} H={heads} "
          f"{kind} scale={scale:.4g}: rel_l2 vs reference {e_ref:.4f}, vs oracle {e_or:.4f} "
          f"(reference {recipe_e:.4f}), cos {cos:.5f} (reference {recipe_cos:.5f})")
    assert e_ref <= REF_REL_L2, f"relative L2 {e_ref:.4f} against the reference emulation"
    if kind == "gauss" and scale == DEFAULT_SCALE:
        assert e_or <= ORACLE_REL_L2, f"relative L2 {e_or:.4f} against the FP32 oracle"
        assert cos >= ORACLE_COS, f"cosine {cos:.5f} against the FP32 oracle"
        torch.testing.assert_close(out.float(), oracle, atol=ORACLE_ATOL, rtol=ORACLE_RTOL)
    else:
        assert e_or <= recipe_e + 0.005, f"relative L2 {e_or:.4f} vs the recipe's {recipe_e:.4f}"
        assert cos >= recipe_cos - 0.002, f"cosine {cos:.5f} vs the recipe's {recipe_cos:.5f}"


# ---------------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------------

SINGLE_LENGTHS = [1, 15, 16, 17, 127, 128, 129, 1000, 4096]


@pytest.mark.parametrize("length", SINGLE_LENGTHS)
def test_single_segment(module: Any, length: int) -> None:
    check_case(module, [length], 2, "gauss", seed=length)


def test_single_segment_16384(module: Any) -> None:
    check_case(module, [16384], 1, "gauss", seed=16384)


PACKED = [
    [0, 5, 0, 295, 1, 1199, 0],  # empty segments at the ends and between
    [128, 129, 127, 64, 63, 65, 1, 0, 2],
    [17] * 40,
    [3000, 0, 0, 77],
]


@pytest.mark.parametrize("lengths", PACKED, ids=lambda x: f"{len(x)}seg")
@pytest.mark.parametrize("heads", [1, 3])
def test_packed(module: Any, lengths: list[int], heads: int) -> None:
    check_case(module, lengths, heads, "gauss", seed=len(lengths) * 10 + heads)


def test_56_heads(module: Any) -> None:
    check_case(module, [700, 0, 1000, 37], 56, "gauss", seed=56)


@pytest.mark.parametrize("kind", ["biased", "heavy", "tiny"])
@pytest.mark.parametrize("lengths", [[1000], [300, 0, 1500, 9]], ids=["single", "packed"])
def test_real_model_like_inputs(module: Any, kind: str, lengths: list[int]) -> None:
    check_case(module, lengths, 4, kind, seed=99)


@pytest.mark.parametrize("scale", [0.3, 0.02])
def test_softmax_scale(module: Any, scale: float) -> None:
    check_case(module, [600, 257], 2, "gauss", seed=5, scale=scale)


# ---------------------------------------------------------------------------------------------
# Execution properties
# ---------------------------------------------------------------------------------------------


def _prepared(module: Any, lengths: list[int], heads: int, seed: int) -> Prepared:
    bounds = bounds_of(lengths)
    return prepare(*make_qkv(bounds[-1], heads, "gauss", seed), bounds, layout_of(module))


def test_deterministic_and_side_stream(module: Any) -> None:
    prep = _prepared(module, [500, 0, 261], 3, seed=11)
    first = run_kernel(module, prep)
    second = run_kernel(module, prep)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        side = run_kernel(module, prep)
    torch.cuda.synchronize()
    assert torch.isfinite(first).all()
    assert torch.equal(first, second)
    assert torch.equal(first, side), "the side-stream launch differs (or ran on another stream)"


def test_cuda_graph_capture_and_replay(module: Any) -> None:
    lengths, heads = [300, 129], 2
    prep = _prepared(module, lengths, heads, seed=21)
    eager = run_kernel(module, prep)
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_kernel(module, prep, out=out)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(module, prep, out=out)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

    # New operands in the same workspace: the replay reads them.
    other = _prepared(module, lengths, heads, seed=22)
    fill_workspace(prep.views, other.stages)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run_kernel(module, other))


def test_no_tokens_launches_nothing(module: Any) -> None:
    for bounds in ([0], [0, 0, 0]):
        layout = layout_of(module)(0, 2, len(bounds) - 1)
        ws = torch.full((max(layout.total_bytes, 1),), POISON, dtype=torch.uint8, device="cuda")
        prep = Prepared(0, 2, bounds, {}, layout.views(ws), device_tables(bounds))
        out = run_kernel(module, prep)
        torch.cuda.synchronize()
        assert out.shape == (0, 2, 128)


def test_argument_checks(module: Any) -> None:
    prep = _prepared(module, [40], 2, seed=3)
    good = torch.empty(40, 2, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="out"):
        module.attention_nvfp4(good.float(), *prep.kernel_args(), DEFAULT_SCALE)
    with pytest.raises(ValueError, match="q_codes"):
        args = list(prep.kernel_args())
        args[1] = args[1][:, :-1]
        module.attention_nvfp4(good, *args, DEFAULT_SCALE)
    with pytest.raises(ValueError, match="softmax_scale"):
        module.attention_nvfp4(good, *prep.kernel_args(), -1.0)
    with pytest.raises(ValueError, match="CUDA"):
        args = list(prep.kernel_args())
        args[-1] = args[-1].cpu()
        module.attention_nvfp4(good, *args, DEFAULT_SCALE)
    with pytest.raises(ValueError, match="k_codes must start on a 16-byte boundary"):
        args = list(prep.kernel_args())
        k_codes = args[3]
        raw = torch.empty(k_codes.numel() + 1, dtype=torch.uint8, device="cuda")
        args[3] = raw[1:].view(k_codes.shape).copy_(k_codes)
        module.attention_nvfp4(good, *args, DEFAULT_SCALE)
