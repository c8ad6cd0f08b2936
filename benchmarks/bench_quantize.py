"""Bandwidth of the quantization pre-pass (quantize_nvfp4 / quantize_fp8, and the Hopper NVFP4
backend's quantize_nvfp4_fp16, which writes FP16 operands) against a D2D copy.

Counted bytes: each input read once (q, k, v: ``3 * T * H * 128 * 2``) plus each output written
once (the used part of every workspace region: codes, scales, means; FP16 operands with their
zero padding). The pre-pass really moves more (k is read twice, and v too for FP8: the means must
be known before anything is quantized); that extra traffic is part of what this measures. The
reference is a device-to-device copy (``dst.copy_(src)``, 1 GiB) timed in the same process: its
bandwidth is ``2 * nbytes / time``. Target: the pre-pass at >= 60 % of the copy's bandwidth.

The "DRAM GB/s" column divides the traffic the pre-pass really moves (the second reads
included, ``dram_bytes_estimate``) by the time: how close the launches together come to the
copy, whatever the accounting.

    python benchmarks/bench_quantize.py                     # 61,440 tokens x 56 heads, 1 segment
    python benchmarks/bench_quantize.py --bounds 0 4096 61440 --heads 14 --json out.json
    python benchmarks/bench_quantize.py --standalone --profile  # per-kernel times (torch.profiler)
    python benchmarks/bench_quantize.py --ops nvfp4_fp16 --baseline-so CACHE_OR_SO --profile

``--standalone`` builds the pre-pass alone (``tests/kernels/test_quantize_build.build_quantize_so``)
instead of the JIT's module; ``--include DIR`` puts DIR before the package headers for that
build (to measure a modified header, e.g. another formats.cuh).

``--baseline-so`` times the Hopper NVFP4 pre-pass as it was before it wrote FP16 itself: the codes
pre-pass then its separate expansion (``quantize_nvfp4`` + ``expand_nvfp4_fp16`` of an
``nvfp4_wgmma`` module built from a commit that had them, e.g. e80190d: the path of its ``.so``,
or a JIT cache directory holding one), in the same process as ``nvfp4_fp16``, and prints the
checksum of its FP16 operands next to the new path's: equal checksums say the two wrote the same
bits. Build it from a checkout of that commit:

    git worktree add /tmp/h3_old e80190d && cd /tmp/h3_old && \
        FLASHINFER_H3_CACHE_DIR=/tmp/h3_old_cache PYTHONPATH=. python -m flashinfer_h3 warmup \
        --arch sm_90a
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashinfer_h3 import reference as R  # noqa: E402
from flashinfer_h3.layout import fp8_layout, nvfp4_fp16_layout, nvfp4_layout  # noqa: E402
from flashinfer_h3.plan import Plan, build_host_plan  # noqa: E402

COPY_BYTES = 1 << 30
TARGET_FRACTION = 0.6
#: op -> (JIT module, export, workspace layout).
VARIANTS = {
    "nvfp4": ("nvfp4", "quantize_nvfp4", nvfp4_layout),
    "fp8": ("fp8", "quantize_fp8", fp8_layout),
    "nvfp4_fp16": ("nvfp4_wgmma", "quantize_nvfp4_fp16", nvfp4_fp16_layout),
}
BASELINE = "nvfp4_fp16 (codes + expansion)"


def load_module(op: str, standalone: bool, include: list[Path]) -> Any:
    name = VARIANTS[op][0]
    if not standalone:
        from flashinfer_h3.jit import get_module

        return get_module(name)
    import tvm_ffi

    sys.path.insert(0, str(REPO / "tests" / "kernels"))
    from test_quantize_build import build_quantize_so

    major, minor = torch.cuda.get_device_capability()
    arch = "sm_90a" if major == 9 else f"sm_{major}{minor}a"
    cache = os.environ.get("FLASHINFER_H3_CACHE_DIR", "").strip()
    out = Path(cache) / "quantize_standalone" if cache else Path(tempfile.mkdtemp())
    so, _ = build_quantize_so(name, arch, out, tuple(include))
    return tvm_ffi.load_module(str(so))


def load_baseline(path: Path) -> tuple[Any, Path]:
    """The ``nvfp4_wgmma`` module of an older build (a ``.so``, or the newest such ``.so`` under a
    directory such as a JIT cache) that exports ``quantize_nvfp4`` and ``expand_nvfp4_fp16``."""
    import tvm_ffi

    if path.is_dir():
        found = sorted(path.rglob("nvfp4_wgmma_*.so"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise SystemExit(f"--baseline-so: no nvfp4_wgmma_*.so under {path}")
        path = found[-1]
    mod = tvm_ffi.load_module(str(path))
    for name in ("quantize_nvfp4", "expand_nvfp4_fp16"):
        try:
            getattr(mod, name)
        except AttributeError:
            raise SystemExit(f"--baseline-so: {path} has no {name} (not a build with the separate "
                             "expansion)") from None
    return mod, path


def used_regions(op: str, views: dict[str, torch.Tensor], bounds: list[int]
                 ) -> dict[str, torch.Tensor]:
    """The parts of the output regions a call writes."""
    if op != "nvfp4_fp16":
        return R.trim_stages(op, views, bounds)
    host = build_host_plan(bounds)
    nqb, nv = host.num_qblocks, host.vkey_start[-1]
    return {"kbar": views["kbar"], "qbar": views["qbar"][:nqb], "q_f16": views["q_f16"],
            "k_f16": views["k_f16"][:, :nv], "v_f16": views["v_f16"][..., :nv]}


def time_ms(fn, iters: int, warmup: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def copy_bandwidth(iters: int, warmup: int, repeats: int) -> float:
    """GB/s of ``dst.copy_(src)`` on 1 GiB: bytes read plus bytes written over the time."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters, warmup, repeats)
    return 2 * COPY_BYTES / ms / 1e6


def checksum(tensors: list[torch.Tensor], chunk: int = 1 << 26) -> int:
    """Position-weighted sum of the bytes: equal outputs of two builds give equal checksums."""
    total = 0
    for t in tensors:
        flat = t.contiguous().view(torch.uint8).view(-1)
        for start in range(0, flat.numel(), chunk):
            b = flat[start : start + chunk].to(torch.int64)
            w = torch.arange(start, start + b.numel(), device=b.device, dtype=torch.int64)
            total += int((b * (w % 65521 + 1)).sum())
    return total


def kernel_times(fn, iters: int) -> dict[str, float]:
    """Average device time per call of each kernel (us), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = getattr(evt, "cuda_time_total", 0.0)
        if total:
            # "quantize_kernel<(Op)0, (Pass)1, 3>(...)": the namespaces dropped, the template
            # arguments kept (they tell the two tile passes apart).
            name = evt.key.replace("void ", "").replace("flashinfer_h3::quantize::", "")
            out[name.split("(Inputs")[0][:90]] = total / iters
    return out


def bench_op(
    op: str,
    mod: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    T, H = q.shape[0], q.shape[1]
    layout = VARIANTS[op][2](T, H, len(bounds) - 1)
    plan = Plan.create(build_host_plan(bounds), H, q.device)
    ws = torch.empty(layout.total_bytes, dtype=torch.uint8, device=q.device)
    views = layout.views(ws)
    regions = [views[r.name] for r in layout.regions if r.name != "item_counter"]
    fn = getattr(mod, VARIANTS[op][1])

    def call() -> None:
        fn(q, k, v, *plan.args, *regions)

    ms = time_ms(call, args.iters, args.warmup, args.repeats)
    used = used_regions(op, views, bounds)
    # What the pre-pass really reads and writes: k is read twice (means first), v too for FP8.
    reread = q.numel() * q.element_size() * (2 if op == "fp8" else 1)
    # For nvfp4_fp16 also what the Hopper kernel reads: comparable with the baseline's.
    fp16 = ("q_f16", "k_f16", "v_f16") if op == "nvfp4_fp16" else ()
    return timing_result(op, call, ms, 3 * q.numel() * q.element_size(), used, reread, fp16, args)


def timing_result(op: str, call: Any, ms: float, in_bytes: int, used: dict[str, torch.Tensor],
                  reread_bytes: int, fp16: tuple[str, ...], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """One row of the JSON: time, bytes (inputs once, outputs once; the DRAM estimate adds
    ``reread_bytes``), checksums of the outputs (and of the FP16 regions named in ``fp16``) and,
    with ``--profile``, each kernel's time."""
    out_bytes = sum(t.numel() * t.element_size() for t in used.values())
    result: dict[str, Any] = {
        "op": op,
        "ms": ms,
        "input_bytes": in_bytes,
        "output_bytes": out_bytes,
        "gbps": (in_bytes + out_bytes) / ms / 1e6,
        "checksum": checksum(list(used.values())),
        "dram_bytes_estimate": in_bytes + out_bytes + reread_bytes,
    }
    if fp16:
        result["fp16_checksum"] = checksum([used[n] for n in fp16])
    result["dram_gbps"] = result["dram_bytes_estimate"] / ms / 1e6
    if args.profile:
        try:
            result["kernels_us"] = kernel_times(call, args.iters)
        except Exception as exc:  # the profiler is optional: keep the timings
            result["profile_error"] = repr(exc)
    return result


def bench_baseline(
    mod: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The Hopper NVFP4 pre-pass before it wrote FP16: the codes pre-pass (quantize_nvfp4, into
    the NVFP4 layout) then the expansion (expand_nvfp4_fp16, codes -> the FP16 regions)."""
    T, H, S = q.shape[0], q.shape[1], len(bounds) - 1
    host = build_host_plan(bounds)
    plan = Plan.create(host, H, q.device)
    codes_layout, fp16_layout = nvfp4_layout(T, H, S), nvfp4_fp16_layout(T, H, S)
    codes = codes_layout.views(torch.empty(codes_layout.total_bytes, dtype=torch.uint8,
                                           device=q.device))
    fp16 = fp16_layout.views(torch.empty(fp16_layout.total_bytes, dtype=torch.uint8,
                                         device=q.device))
    code_regions = [codes[r.name] for r in codes_layout.regions]
    targets = (fp16["q_f16"], fp16["k_f16"], fp16["v_f16"])
    seg_bounds, vkey_start = plan.args[0], plan.args[1]
    nv = host.vkey_start[-1]

    def call() -> None:
        mod.quantize_nvfp4(q, k, v, *plan.args, *code_regions)
        mod.expand_nvfp4_fp16(*code_regions[2:], seg_bounds, vkey_start, *targets, nv)

    ms = time_ms(call, args.iters, args.warmup, args.repeats)
    used = {**R.trim_stages("nvfp4", codes, bounds), "q_f16": fp16["q_f16"],
            "k_f16": fp16["k_f16"][:, :nv], "v_f16": fp16["v_f16"][..., :nv]}
    code_bytes = sum(used[n].numel() for n in ("q_codes", "q_scales", "k_codes", "k_scales",
                                               "v_codes", "v_scales"))
    # k read twice, and the expansion reads back every code and scale
    reread = q.numel() * q.element_size() + code_bytes
    return timing_result(BASELINE, call, ms, 3 * q.numel() * q.element_size(), used, reread,
                         ("q_f16", "k_f16", "v_f16"), args)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=61_440)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--bounds", type=int, nargs="+", help="cu_seqlens (default: one segment)")
    p.add_argument("--ops", nargs="+", default=["nvfp4", "fp8"], choices=list(VARIANTS),
                   help="nvfp4_fp16: the Hopper NVFP4 backend's pre-pass (sm_90a)")
    p.add_argument("--baseline-so", type=Path, metavar="SO_OR_DIR",
                   help="an older nvfp4_wgmma module (.so, or a cache directory holding one) with "
                        "the separate FP16 expansion: timed as its codes pre-pass + expansion "
                        "beside nvfp4_fp16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--standalone", action="store_true", help="build the pre-pass alone")
    p.add_argument(
        "--include",
        type=Path,
        action="append",
        default=[],
        help="header directory searched first (with --standalone)",
    )
    p.add_argument("--profile", action="store_true", help="per-kernel times (torch.profiler)")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    bounds = args.bounds or [0, args.tokens]
    T, H = bounds[-1], args.heads
    torch.manual_seed(args.seed)
    q, k, v = (torch.randn(T, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    copy_gbps = copy_bandwidth(args.iters, args.warmup, args.repeats)

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "tokens": T,
        "heads": H,
        "segments": len(bounds) - 1,
        "copy_gbps": copy_gbps,
        "include": [str(d) for d in args.include],
        "ops": [],
    }
    print(
        f"{results['device']}: {T} tokens x {H} heads, {len(bounds) - 1} segment(s); "
        f"D2D copy {copy_gbps:.0f} GB/s"
    )
    print(
        f"{'op':30} {'ms':>8} {'in MB':>9} {'out MB':>9} {'GB/s':>8} {'of copy':>8} "
        f"{'DRAM GB/s':>10}"
    )
    runs: list[tuple[str, Any]] = [(op, None) for op in args.ops]
    if args.baseline_so is not None:
        base_mod, base_path = load_baseline(args.baseline_so)
        results["baseline_so"] = str(base_path)
        runs.append((BASELINE, base_mod))
    for op, base_mod in runs:
        if base_mod is not None:
            r = bench_baseline(base_mod, q, k, v, bounds, args)
        else:
            r = bench_op(op, load_module(op, args.standalone, args.include), q, k, v, bounds, args)
        r["fraction_of_copy"] = r["gbps"] / copy_gbps
        r["meets_target"] = r["fraction_of_copy"] >= TARGET_FRACTION
        results["ops"].append(r)
        print(
            f"{op:30} {r['ms']:8.3f} {r['input_bytes'] / 1e6:9.1f} {r['output_bytes'] / 1e6:9.1f} "
            f"{r['gbps']:8.0f} {100 * r['fraction_of_copy']:7.1f}% {r['dram_gbps']:10.0f}"
        )
        for name, us in r.get("kernels_us", {}).items():
            print(f"    {us:9.1f} us  {name}")
    fp16 = {r["op"]: r for r in results["ops"] if "fp16_checksum" in r}
    if BASELINE in fp16 and "nvfp4_fp16" in fp16:
        new, old = fp16["nvfp4_fp16"], fp16[BASELINE]
        same = new["fp16_checksum"] == old["fp16_checksum"]
        results["fp16_gain_ms"] = old["ms"] - new["ms"]
        results["fp16_same_bits"] = same
        print(f"nvfp4_fp16 vs codes + expansion: {old['ms'] - new['ms']:+.3f} ms saved "
              f"({old['ms']:.3f} -> {new['ms']:.3f}); FP16 operands "
              f"{'identical (checksum)' if same else 'DIFFER'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
