"""GPU tests of the quantization pre-pass (quantize_nvfp4 / quantize_fp8, and on Hopper
quantize_nvfp4_fp16: the NVFP4 pre-pass of the nvfp4_wgmma module, which writes the Hopper kernel's
FP16 operands instead of codes) against the reference.

For every case the workspace is poisoned, the kernel runs, and then:

- the means are finite and within 1e-6 of the reference's FP64 means, relative to the mean
  magnitude of the rows averaged (``|kernel - ref| <= 1e-6 * mean|x|``: a relative error
  against the mean itself is meaningless for a mean near 0);
- every code and scale is bit-identical to ``reference.*_quantize_stages`` given the kernel's
  means (so any poisoned byte left in a used region fails); for ``nvfp4_fp16`` every FP16 value
  is bit-identical to ``reference.nvfp4_fp16_operands`` of those stages (the decoded codes in the
  window key order, the zero padding included);
- every byte the layout calls unused (gaps between regions, qbar rows past NQB, V columns and
  FP16 K rows past ``vkey_start[S]``, FP8 k_scales past NQB, the item counter, the workspace
  tail) still holds the poison.

Inputs: Gaussian, per-channel-biased q/k with outlier channels, heavy-tailed magnitudes over
many decades (zero and subnormal scales, saturation), exact and negative zeros; segments of
lengths 0, 1, 15/16/17, 63/64/65, 127/128/129, ..., 10k segments, heads 1..64, tokens = 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from flashinfer_h3 import reference as R
from flashinfer_h3.layout import fp8_layout, nvfp4_fp16_layout, nvfp4_layout
from flashinfer_h3.plan import Plan, build_host_plan

pytestmark = pytest.mark.gpu

POISON = 0xA5
TAIL_BYTES = 4096  # workspace bytes past the layout's total, checked untouched
MEAN_RTOL = 1e-6
# Build the pre-pass alone instead of the JIT's module (the nvfp4 module also compiles the
# attention template, which a pre-pass test does not need).
STANDALONE_ENV = "FLASHINFER_H3_TEST_QUANTIZE_STANDALONE"
# Header directories searched before the package's (os.pathsep-separated; implies standalone):
# validates a modified header, e.g. another formats.cuh, against the reference.
INCLUDE_ENV = "FLASHINFER_H3_TEST_QUANTIZE_INCLUDE"


# ---------------------------------------------------------------------------------------------
# Module, inputs, one call
# ---------------------------------------------------------------------------------------------

#: The pre-pass variants: op -> (module that exports it, export, workspace layout).
VARIANTS = {
    "nvfp4": ("nvfp4", "quantize_nvfp4", nvfp4_layout),
    "fp8": ("fp8", "quantize_fp8", fp8_layout),
    "nvfp4_fp16": ("nvfp4_wgmma", "quantize_nvfp4_fp16", nvfp4_fp16_layout),
}


def layout_of(op: str, tokens: int, heads: int, segments: int) -> Any:
    return VARIANTS[op][2](tokens, heads, segments)


def operand_regions(op: str, layout: Any) -> list[str]:
    """The layout's regions the pre-pass takes, in its argument order (all but the Hopper
    kernel's item counter)."""
    return [r.name for r in layout.regions if r.name != "item_counter"]


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return "sm_90a" if major == 9 else f"sm_{major}{minor}a"


def _standalone(module_name: str) -> Any:
    import tvm_ffi
    from test_quantize_build import build_quantize_so

    include = tuple(Path(d) for d in os.environ.get(INCLUDE_ENV, "").split(os.pathsep) if d)
    out_dir = Path(os.environ["FLASHINFER_H3_CACHE_DIR"]) / "quantize_standalone"
    so, _ = build_quantize_so(module_name, _arch(), out_dir, include)
    return tvm_ffi.load_module(str(so))


class _Modules(dict):
    """op -> module, loaded on first use (a test of one op builds only that op)."""

    def __missing__(self, op: str) -> Any:
        from flashinfer_h3.jit import TemplateNotFoundError, get_module

        name = VARIANTS[op][0]
        if name == "nvfp4_wgmma" and torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("quantize_nvfp4_fp16 is the Hopper (compute capability 9.0) pre-pass")
        if os.environ.get(STANDALONE_ENV) == "1" or os.environ.get(INCLUDE_ENV):
            module = _standalone(name)
        else:
            try:
                module = get_module(name)
            except TemplateNotFoundError:  # the module's attention template is not there
                module = _standalone(name)
        self[op] = module
        return module


@pytest.fixture(scope="module")
def modules() -> dict[str, Any]:
    return _Modules()


def make_qkv(
    tokens: int, heads: int, kind: str, seed: int, device: str = "cuda"
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    shape = (tokens, heads, 128)
    if kind == "gaussian":
        q, k, v = randn(*shape), randn(*shape), randn(*shape)
    elif kind == "biased":  # real-model-like: per-channel offsets and a few outlier channels
        bias_q, bias_k = randn(heads, 128) * 3, randn(heads, 128) * 3
        bias_k[:, ::37] *= 30
        q = randn(*shape) + bias_q
        k = randn(*shape) * 0.5 + bias_k
        v = randn(*shape) * 2 + randn(heads, 128)
    elif kind == "heavy":  # per-token magnitudes over ~10 decades: zero/subnormal scales, 6/448 sat

        def heavy() -> torch.Tensor:
            return randn(*shape) * torch.exp(randn(tokens, heads, 1) * 4)

        q, k, v = heavy(), heavy(), heavy()
    elif kind == "tiny":  # FP8 scales below 2^-126 (SPEC 4.1: flushed to 0 with their codes)
        q, k, v = randn(*shape), randn(*shape), randn(*shape)
        q[::7] *= 1e-37  # Q rows
        k[: tokens // 3] *= 1e-37  # whole K' blocks where a segment lies inside
        v[:, :, :8] *= 1e-37  # V channels of every segment
    else:
        raise ValueError(kind)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    if tokens >= 4:  # exact zeros, negative zeros, constant rows (zero groups after smoothing)
        v[1] = -0.0
        v[2, :, :64] = 0.0
        q[3] = q[0]
        k[tokens // 2, :, 16:32] = -0.0
    return q.contiguous(), k.contiguous(), v.contiguous()


def run_quantize(
    mod: Any, op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]
) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any, Any]:
    T, H = q.shape[0], q.shape[1]
    S = len(bounds) - 1
    layout = layout_of(op, T, H, S)
    plan = Plan.create(build_host_plan(bounds), H, q.device)
    ws = torch.full((layout.total_bytes + TAIL_BYTES,), POISON, dtype=torch.uint8, device="cuda")
    views = layout.views(ws)
    names = operand_regions(op, layout)
    getattr(mod, VARIANTS[op][1])(q, k, v, *plan.args, *(views[n] for n in names))
    torch.cuda.synchronize()
    return views, ws, layout, plan.host


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    diff = (_bits(got) != _bits(want)).view(-1)
    if diff.any():
        n = int(diff.sum())
        first = int(diff.nonzero()[0])
        raise AssertionError(f"{name}: {n} of {diff.numel()} bytes differ (first at byte {first})")


def assert_means_close(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, name: str) -> None:
    assert torch.isfinite(got).all(), f"{name}: non-finite means"
    err = (got.double() - want.double()).abs()
    bound = MEAN_RTOL * mag.double()
    bad = err > bound
    if bad.any():
        worst = float((err / bound.clamp_min(1e-300)).max())
        raise AssertionError(
            f"{name}: {int(bad.sum())} means off by more than "
            f"{MEAN_RTOL} * mean|x| (worst {worst:.2f}x the bound)"
        )


def assert_poisoned(x: torch.Tensor, what: str) -> None:
    b = _bits(x)
    if b.numel() and not (b == POISON).all():
        raise AssertionError(f"{what}: {int((b != POISON).sum())} unused bytes were written")


def check_call(
    op: str,
    views: dict[str, torch.Tensor],
    ws: torch.Tensor,
    layout: Any,
    host: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    bounds = list(host.bounds)
    nqb, nv = host.num_qblocks, host.vkey_start[-1]
    if op == "nvfp4_fp16":
        got = {"kbar": views["kbar"], "qbar": views["qbar"][:nqb], "q_f16": views["q_f16"],
               "k_f16": views["k_f16"][:, :nv], "v_f16": views["v_f16"][..., :nv]}
    else:
        got = R.trim_stages(op, views, bounds)
    kbar_ref, qbar_ref = R.nvfp4_means(q, k, bounds)
    kmag, qmag = R.nvfp4_means(q.abs(), k.abs(), bounds)
    assert_means_close(got["kbar"], kbar_ref, kmag, "kbar")
    if op in ("nvfp4", "nvfp4_fp16"):
        assert_means_close(got["qbar"], qbar_ref, qmag, "qbar")
        ref = R.nvfp4_quantize_stages(q, k, v, bounds, kbar=got["kbar"], qbar=got["qbar"])
        if op == "nvfp4_fp16":
            ref = R.nvfp4_fp16_operands(ref, bounds)
    else:
        ref = R.fp8_quantize_stages(q, k, v, bounds, kbar=got["kbar"])
    for name, want in ref.items():
        if name in ("kbar", "qbar"):
            continue
        assert_bits_equal(got[name], want, name)

    # Unused bytes: between regions, past the layout, and the capped parts of regions.
    regions = sorted(layout.regions, key=lambda r: r.offset)
    for r, nxt in zip(regions, regions[1:] + [None], strict=True):
        end = nxt.offset if nxt is not None else ws.numel()
        assert_poisoned(ws[r.offset + r.nbytes : end], f"bytes after region {r.name}")
    if op == "nvfp4_fp16":
        assert_poisoned(views["qbar"][nqb:], "qbar rows past NQB")
        assert_poisoned(views["k_f16"][:, nv:], "k_f16 rows past vkey_start[S]")
        assert_poisoned(views["v_f16"][..., nv:], "v_f16 columns past vkey_start[S]")
        assert_poisoned(views["item_counter"], "item_counter")
    elif op == "nvfp4":
        assert_poisoned(views["qbar"][nqb:], "qbar rows past NQB")
        assert_poisoned(views["v_codes"][..., nv // 2 :], "v_codes columns past vkey_start[S]")
        assert_poisoned(views["v_scales"][..., nv // 16 :], "v_scales columns past vkey_start[S]")
    else:
        assert_poisoned(views["k_scales"][:, nqb:], "k_scales columns past NQB")
        assert_poisoned(views["v_codes"][..., nv:], "v_codes columns past vkey_start[S]")


def run_and_check(
    modules: dict[str, Any], op: str, bounds: list[int], heads: int, kind: str, seed: int
) -> None:
    q, k, v = make_qkv(bounds[-1], heads, kind, seed)
    views, ws, layout, host = run_quantize(modules[op], op, q, k, v, bounds)
    check_call(op, views, ws, layout, host, q, k, v)


def random_bounds(gen: torch.Generator, segments: int, max_len: int) -> list[int]:
    lengths = torch.randint(0, max_len + 1, (segments,), generator=gen)
    lengths[torch.rand(segments, generator=gen) < 0.15] = 0
    return [0, *torch.cumsum(lengths, 0).tolist()]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

OPS = ("nvfp4", "fp8", "nvfp4_fp16")
KINDS = ("gaussian", "biased", "heavy", "tiny")
EDGE_LENGTHS = [0, 1, 15, 16, 17, 0, 63, 64, 65, 127, 128, 129, 0, 0, 255, 256, 257, 2, 300]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", OPS)
def test_edge_lengths(modules, op: str, kind: str) -> None:
    bounds = [0]
    for n in EDGE_LENGTHS:
        bounds.append(bounds[-1] + n)
    run_and_check(modules, op, bounds, heads=3, kind=kind, seed=1)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 127, 128, 129, 640, 5000])
@pytest.mark.parametrize("op", OPS)
def test_single_segment(modules, op: str, length: int) -> None:
    run_and_check(modules, op, [0, length], heads=2, kind="biased", seed=length)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("op", OPS)
def test_random_shapes(modules, op: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    segments = int(torch.randint(1, 9, (1,), generator=gen))
    heads = (1, 2, 5, 8, 13)[seed % 5]
    bounds = random_bounds(gen, segments, max_len=700)
    run_and_check(modules, op, bounds, heads, KINDS[seed % len(KINDS)], seed)


@pytest.mark.parametrize("op", OPS)
def test_64_heads(modules, op: str) -> None:
    run_and_check(modules, op, [0, 130, 135, 135, 300], heads=64, kind="heavy", seed=7)


@pytest.mark.parametrize("op", OPS)
def test_10k_segments(modules, op: str) -> None:
    gen = torch.Generator().manual_seed(3)
    bounds = random_bounds(gen, 10_000, max_len=4)
    bounds[-1] += 200  # and one long last segment
    run_and_check(modules, op, bounds, heads=2, kind="gaussian", seed=3)


@pytest.mark.parametrize("op", OPS)
def test_long_segment_means(modules, op: str) -> None:
    # 240 blocks in one segment: launch 2 adds them in 32 thread slices, a head's channels split
    # over 4 CTAs.
    run_and_check(modules, op, [0, 30_720], heads=4, kind="biased", seed=11)


@pytest.mark.parametrize("op", OPS)
def test_model_heads(modules, op: str) -> None:
    # The model's 56 heads over two segments with partial last blocks: ~40 tiles per CTA of the
    # persistent launch 3, so every CTA goes round its ring of shared-memory stages many times.
    run_and_check(modules, op, [0, 5000, 8100], heads=56, kind="biased", seed=56)


@pytest.mark.parametrize("bounds", [[0], [0, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("op", OPS)
def test_no_tokens(modules, op: str, bounds: list[int]) -> None:
    q = k = v = torch.empty(0, 4, 128, dtype=torch.bfloat16, device="cuda")
    views, ws, layout, host = run_quantize(modules[op], op, q, k, v, bounds)
    assert torch.equal(views["kbar"], torch.zeros_like(views["kbar"]))  # 0 for empty segments
    if op == "fp8":
        assert torch.equal(views["v_scales"], torch.zeros_like(views["v_scales"]))
    kbar = layout["kbar"]
    written = kbar.nbytes + (layout["v_scales"].nbytes if op == "fp8" else 0)
    assert int((ws != POISON).sum()) <= written


@pytest.mark.parametrize("op", OPS)
def test_deterministic_and_stream_ordered(modules, op: str) -> None:
    bounds = [0, 3000, 3001, 4500]
    q, k, v = make_qkv(bounds[-1], 6, "biased", 5)
    _, ws1, _, _ = run_quantize(modules[op], op, q, k, v, bounds)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _, ws2, _, _ = run_quantize(modules[op], op, q, k, v, bounds)
    side.synchronize()
    assert torch.equal(ws1, ws2)


@pytest.mark.parametrize("op", OPS)
def test_rejects_bad_arguments(modules, op: str) -> None:
    bounds = [0, 100]
    q, k, v = make_qkv(100, 2, "gaussian", 0)
    layout = layout_of(op, 100, 2, 1)
    plan = Plan.create(build_host_plan(bounds), 2, q.device)
    ws = torch.full((layout.total_bytes,), POISON, dtype=torch.uint8, device="cuda")
    views = [layout.views(ws)[n] for n in operand_regions(op, layout)]
    fn = getattr(modules[op], VARIANTS[op][1])
    with pytest.raises(ValueError, match="q must be bfloat16"):
        fn(q.half(), k, v, *plan.args, *views)
    with pytest.raises(ValueError, match="k must have shape"):
        fn(q, k[:50], v, *plan.args, *views)
    with pytest.raises(ValueError, match="kbar must have shape"):
        fn(q, k, v, *plan.args, views[0][:, :1], *views[1:])
    with pytest.raises(ValueError, match="seg_bounds must be on cuda"):
        fn(q, k, v, plan.args[0].cpu(), *plan.args[1:], *views)
    with pytest.raises(ValueError, match="must be contiguous"):
        fn(q, k, v.transpose(0, 1).contiguous().transpose(0, 1), *plan.args, *views)
    if op == "nvfp4_fp16":
        with pytest.raises(ValueError, match="q_f16 must be float16"):
            fn(q, k, v, *plan.args, *views[:2], views[2].view(torch.int16), *views[3:])
        with pytest.raises(ValueError, match=r"v_f16 must have shape \[2, 128, 128\]"):
            fn(q, k, v, *plan.args, *views[:4], views[4][..., :64].contiguous())
        with pytest.raises(ValueError, match="k_f16 .* 0 key positions"):
            fn(q, k, v, *plan.args, *views[:3], views[3][:, :0], views[4][..., :0])
    torch.cuda.synchronize()
    assert (ws == POISON).all()  # nothing ran
