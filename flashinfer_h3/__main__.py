"""Command line: ``python -m flashinfer_h3 {info,warmup,check,bench}``.

- ``info``: versions, GPUs and their kernel arch, nvcc, cache and prebuilt kernels.
- ``warmup``: build every module of the chosen archs and ops (works without a GPU with --arch).
- ``check``: each operator on a small random input against the reference and the FP32 oracle
  (without a GPU: the reference against the oracle).
- ``bench``: the MiniMax-H3 attention shapes on the present GPU, side by side with PyTorch's
  cuDNN and flash BF16 attention; for a kernel backend both the whole call and its attention
  kernel alone (without a GPU: the reference on a small preset).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .constants import HEAD_DIM
from .version import __version__

OPERATORS = ("nvfp4", "fp8")

# Accuracy bars of SPEC 5: (relative L2 vs oracle, cosine vs oracle); vs reference: REF_L2.
ORACLE_BARS = {"nvfp4": (0.21, 0.975), "fp8": (0.06, 0.998)}
REF_L2 = 0.02


def _print(*args: Any) -> None:
    print(*args, flush=True)


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.replace(";", ",").split(",") if item.strip()]


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from . import jit
    from .jit import env

    _print(f"flashinfer_h3 {__version__} ({Path(__file__).resolve().parent})")
    try:
        import torch

        torch_text = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})"
    except ImportError:
        torch = None  # type: ignore[assignment]
        torch_text = "torch: not installed"
    _print(
        f"python {platform.python_version()}, {torch_text}, apache-tvm-ffi {env.tvm_ffi_version()}"
    )

    if torch is not None and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            try:
                arch = env.arch_for_capability(major, minor)
            except env.UnsupportedArchError:
                arch = "no kernels for this GPU"
            _print(
                f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability "
                f"{major}.{minor} -> {arch}"
            )
    else:
        _print("GPU: none visible to torch")
    override = os.environ.get(env.ENV_ARCH_LIST)
    if override:
        _print(f"{env.ENV_ARCH_LIST}={override}")

    nvcc = env.find_nvcc()
    if nvcc is None:
        _print(f"nvcc: not found ({env.install_hint()})")
    else:
        try:
            full, (major, minor) = env.nvcc_version(nvcc)
            _print(f"nvcc: {nvcc} (CUDA {major}.{minor}, {full})")
        except env.JitError as exc:
            _print(f"nvcc: {nvcc} is unusable: {exc}")
    _print(f"templates: {env.templates_dir()}")
    root = env.cache_root() / __version__
    cached = sorted(p.parent.name for p in root.glob("*/*/manifest.json")) if root.is_dir() else []
    _print(f"cache: {root} ({len(cached)} module(s) built)")
    for arch_dir in sorted(root.glob("*")) if root.is_dir() else []:
        names = sorted(p.parent.name for p in arch_dir.glob("*/manifest.json"))
        if names:
            _print(f"  {arch_dir.name}: {', '.join(names)}")
    dirs = jit.prebuilt_dirs()
    prebuilt = jit.list_prebuilt()
    if prebuilt:
        _print(f"prebuilt kernels: {len(prebuilt)}")
        for so, entry in prebuilt:
            _print(
                f"  {entry.get('module', entry.get('op'))} {entry.get('arch')} "
                f"head_dim={entry.get('head_dim')}: {so}"
            )
    else:
        where = (
            ", ".join(str(d) for d in dirs)
            if dirs
            else (f"{env.ENV_PREBUILT_DIR} unset, flashinfer_h3_jit_cache not installed")
        )
        _print(f"prebuilt kernels: none ({where})")
    if env.jit_disabled():
        _print(f"{env.ENV_DISABLE_JIT}=1: a cache miss is an error")
    _print_backends(getattr(args, "arch", None), torch)
    return 0


def _info_targets(arch_arg: str | None, torch: Any) -> list[tuple[str, str]]:
    """``(arch, where)`` to describe: --arch, else the visible GPUs, else the arch override."""
    from .jit import env

    if arch_arg:
        return [(a, "--arch") for a in env.parse_arch_list(arch_arg)]
    targets: list[tuple[str, str]] = []
    if torch is not None and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            try:
                arch = env.arch_for_capability(*torch.cuda.get_device_capability(i))
            except env.UnsupportedArchError:
                continue
            if arch not in [a for a, _ in targets]:
                targets.append((arch, f"GPU {i}"))
    if not targets:
        targets = [(a, env.ENV_ARCH_LIST) for a in env.arch_list_override() or []]
    return targets


def _print_backends(arch_arg: str | None, torch: Any) -> None:
    """For each target: the backend each operator resolves to, for the current choice."""
    from . import backends
    from .jit.env import ARCHS

    targets = _info_targets(arch_arg, torch)
    if not targets:
        _print("backends: no GPU with kernels visible; pass --arch sm_90a or --arch sm_120a to "
               "see which backend each operator would use there")
        return
    for arch, where in targets:
        major, minor = ARCHS[arch].capability
        _print(f"backends on {arch} (compute capability {major}.{minor}, {where}):")
        for op in backends.OPERATORS:
            choice, source = backends.current_choice(op)
            try:
                b = backends.resolve_for_arch(op, arch, choice, source=source)
            except (ValueError, RuntimeError) as exc:
                _print(f"  {op:5s}: none: {exc}")
                continue
            how = f"module {b.module}" if b.module else "no kernel module"
            chosen = "auto" if choice == "auto" else f"{source}={choice}"
            others = [o.name for o in backends.backends(op) if o is not b and o.runs_on(arch)]
            _print(f"  {op:5s}: {b.label} [{chosen}; {how}]: {b.summary}")
            if others:
                _print(f"         also runs here: {', '.join(others)}")


def _backend_label(op: str) -> str:
    """``mma_sync_fp4_emulated (kernel)`` or ``reference (torch emulation)`` for this GPU."""
    import torch

    from . import backends

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        return backends.prepared(op, device).backend.label
    except (ValueError, RuntimeError) as exc:
        return f"no backend: {exc}"


# ---------------------------------------------------------------------------------------------
# warmup
# ---------------------------------------------------------------------------------------------


class ProgressBar:
    """A one-line bar on a terminal; one line per step otherwise (logs, CI)."""

    def __init__(self, total: int, width: int = 24) -> None:
        self.total, self.width, self.done = total, width, 0
        self.tty = sys.stderr.isatty()

    def show(self, label: str) -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def step(self, label: str) -> None:
        self.done += 1
        self.show(label)


def _warmup_archs(arg: str | None) -> list[str]:
    from .jit import env

    if arg:
        return env.parse_arch_list(arg)
    override = env.arch_list_override()
    if override:
        return override
    import torch

    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        raise env.UnsupportedArchError(
            "warmup: no CUDA GPU is visible; name the targets with --arch (e.g. --arch "
            "sm_90a,sm_120a) or FLASHINFER_H3_CUDA_ARCH_LIST"
        )
    archs: list[str] = []
    for i in range(torch.cuda.device_count()):
        arch = env.arch_for_capability(*torch.cuda.get_device_capability(i))
        if arch not in archs:
            archs.append(arch)
    return archs


def cmd_warmup(args: argparse.Namespace) -> int:
    import logging

    from .jit import KernelConfig, build_module, env, production_configs
    from .jit.spec import OPS

    archs = _warmup_archs(args.arch)
    ops = _split_list(args.op) if args.op else list(OPS)
    try:
        production_configs(archs, ops)
    except ValueError as exc:
        raise ValueError(f"warmup --op: {exc}".replace("unknown module(s)", "unknown op(s)")) \
            from None
    if "utils" not in ops:
        ops.insert(0, "utils")  # every operator's tests and poisoning use it
    # Every production module of jit/modules.py the ops name (an operator names all of its
    # modules), for each arch it is built for.
    configs = production_configs(archs, ops)
    _print(
        f"warmup: {len(configs)} module(s): ops {', '.join(ops)} for {', '.join(archs)} "
        f"(cache {env.cache_root() / __version__})"
    )
    bar = ProgressBar(len(configs))
    bar.show("starting")
    jit_logger = logging.getLogger("flashinfer_h3.jit")
    level = jit_logger.level
    jit_logger.setLevel(logging.WARNING)  # the bar says what is being built
    failures: list[tuple[KernelConfig, Exception]] = []
    try:
        for cfg in configs:
            start = time.perf_counter()
            try:
                build_module(cfg)
                status = f"{cfg.module} {cfg.arch} ({time.perf_counter() - start:.1f} s)"
            except env.JitError as exc:
                failures.append((cfg, exc))
                status = f"{cfg.module} {cfg.arch} FAILED"
            bar.step(status)
    finally:
        jit_logger.setLevel(level)
    for cfg, exc in failures:
        _print(f"\nwarmup: {cfg.module} for {cfg.arch} failed:\n{exc}")
    if failures:
        return 1
    _print(f"warmup: done, {len(configs)} module(s) ready")
    return 0


# ---------------------------------------------------------------------------------------------
# shared by check and bench
# ---------------------------------------------------------------------------------------------


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _operator(op: str) -> Callable[..., Any]:
    from . import diffusion_ops

    return getattr(diffusion_ops, f"minimax_h3_sm120_varlen_attention_{op}")


def _reference(op: str) -> Callable[..., Any]:
    from . import reference

    return getattr(reference, f"varlen_attention_{op}_reference")


def _inputs(lengths: Sequence[int], heads: int, device: Any, seed: int) -> tuple[Any, ...]:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tokens = sum(lengths)
    shape = (tokens, heads, HEAD_DIM)
    q, k, v = (
        torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(3)
    )
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return q, k, v, cu, bounds


def _compare(out: Any, ref: Any) -> tuple[float, float, bool]:
    """(relative L2, cosine, all finite) of ``out`` against ``ref`` in FP64."""
    o, r = out.double().flatten(), ref.double().flatten()
    finite = bool(o.isfinite().all())
    rel = float((o - r).norm() / r.norm().clamp_min(1e-30))
    cos = float((o @ r) / (o.norm() * r.norm()).clamp_min(1e-30))
    if not finite:
        rel, cos = math.inf, 0.0
    return rel, cos, finite


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from .reference import attention_oracle

    ops = _split_list(args.op) if args.op else list(OPERATORS)
    for op in ops:
        if op not in OPERATORS:
            raise ValueError(
                f"check --op: unknown operator {op!r}; expected {', '.join(OPERATORS)}"
            )
    gpu = _has_gpu()
    device = torch.device("cuda") if gpu else torch.device("cpu")
    # Two segments plus an empty one and a short tail: block edges, the empty-segment path and a
    # short last V group are all exercised, yet the CPU reference finishes in seconds.
    lengths = (300, 0, 181, 17) if gpu else (200, 0, 75)
    heads = 3 if gpu else 2
    q, k, v, cu, bounds = _inputs(lengths, heads, device, args.seed)
    oracle = attention_oracle(q, k, v, cu, cu_seqlens_host=bounds)
    where = torch.cuda.get_device_name(device) if gpu else "CPU (no GPU: reference only)"
    _print(f"check on {where}: segments {list(lengths)}, {heads} heads, seed {args.seed}")
    ok = True
    for op in ops:
        ref = _reference(op)(q, k, v, cu, cu_seqlens_host=bounds)
        l2_bar, cos_bar = ORACLE_BARS[op]
        label = _backend_label(op) if gpu else ""
        if gpu and "(kernel)" not in label:
            # The operator runs on the torch emulation here: comparing it with the reference
            # would compare the reference with itself. Say so, and check it against the oracle.
            out = torch.full_like(q, float("nan"))
            _operator(op)(q, k, v, cu, out, cu_seqlens_host=bounds)
            torch.cuda.synchronize()
            rel, cos, finite = _compare(out, oracle)
            passed = finite and rel <= l2_bar and cos >= cos_bar
            _print(
                f"  {op:5s} {label}, no kernel on this GPU: rel L2 vs oracle {rel:.4f} "
                f"(<= {l2_bar}), cosine {cos:.5f} (>= {cos_bar}) {'PASS' if passed else 'FAIL'}"
            )
        elif gpu:
            out = torch.full_like(q, float("nan"))  # every element must be written
            _operator(op)(q, k, v, cu, out, cu_seqlens_host=bounds)
            torch.cuda.synchronize()
            rel_ref, _, finite_ref = _compare(out, ref)
            rel, cos, finite = _compare(out, oracle)
            passed = (
                finite and finite_ref and rel_ref <= REF_L2 and rel <= l2_bar and cos >= cos_bar
            )
            _print(
                f"  {op:5s} {label}: rel L2 vs reference {rel_ref:.4f} (<= {REF_L2}), vs "
                f"oracle {rel:.4f} (<= {l2_bar}), cosine {cos:.5f} (>= {cos_bar}) "
                f"{'PASS' if passed else 'FAIL'}"
            )
        else:
            rel, cos, finite = _compare(ref, oracle)
            passed = finite and rel <= l2_bar and cos >= cos_bar
            _print(
                f"  {op:5s} reference: rel L2 vs oracle {rel:.4f} (<= {l2_bar}), cosine "
                f"{cos:.5f} (>= {cos_bar}) {'PASS' if passed else 'FAIL'}"
            )
        ok &= passed
    _print("check: all passed" if ok else "check: FAILED")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    lengths: tuple[int, ...]
    heads: int
    about: str


PRESETS: dict[str, Preset] = {
    "h3-10s": Preset((61440,), 56, "MiniMax-H3 10 s 768p: one 61,440-token segment, 56 heads"),
    "h3-15s-sp4": Preset((92160,), 14, "MiniMax-H3 15 s at Ulysses SP=4: 92,160 tokens, 14 heads"),
    "h3-mix": Preset(
        (30720, 15360, 9216, 4096, 1536, 333),
        56,
        "a packed mix of six requests (61,261 tokens), 56 heads",
    ),
    "small": Preset((1000, 537), 4, "a small shape (CPU reference runs)"),
}
DEFAULT_PRESET = "h3-10s"


def attention_flops(lengths: Sequence[int], heads: int) -> float:
    """SPEC 6: ``4 * sum(L^2) * heads * 128`` (two GEMMs, 2 FLOPs per multiply-add)."""
    return 4.0 * sum(length * length for length in lengths) * heads * HEAD_DIM


def _time_cuda(fn: Callable[[], Any], iters: int, warmup: int, warmup_ms: float = 0.0,
               during: AbstractContextManager[Any] | None = None) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, each bracketed by CUDA events, after
    ``warmup`` untimed runs and then more until ``warmup_ms`` of wall time has passed; the GPU
    is idle when the timed runs start. ``during``: a context entered around the timed runs only
    (``_timed``'s clock sampler: the warm-up's samples would describe the previous row's clock).

    Why a warm-up in time: these kernels run at the GPU's power cap, where the SM clock follows
    the board's power with a lag of a few hundred ms; a row timed right after a hungrier one
    starts at that one's clock (an identical build measured up to 3.5 % slower when timed first
    in every round, benchmarks/RESULTS.md, twenty-sixth session)."""
    import torch

    start = time.perf_counter()
    done = 0
    while done < warmup or (time.perf_counter() - start) * 1e3 < warmup_ms:
        fn()
        torch.cuda.synchronize()
        done += 1
    torch.cuda.synchronize()  # nothing queued before the first timed run (warmup 0 included)
    times = []
    with during if during is not None else contextlib.nullcontext():
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _timed(fn: Callable[[], Any], iters: int, warmup: int,
           warmup_ms: float = 0.0) -> tuple[float, Any]:
    """``_time_cuda`` with the GPU's clock, power and temperature sampled over the timed runs
    (benchtools.GpuState, None without nvidia-smi)."""
    import torch

    from . import benchtools

    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    sampler = benchtools.GpuSampler(index)
    ms = _time_cuda(fn, iters, warmup, warmup_ms, during=sampler)
    return ms, sampler.state


def _state_text(state: Any) -> str:
    if state is None:
        return ""
    return (f" (SM {state.sm_clock_mhz:.0f} MHz, {state.power_w:.0f} W, "
            f"{state.temperature_c:.0f} C)")


GPU_PRESET_NOTE = "needs a CUDA GPU"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _bench_presets(arg: str | None, gpu: bool) -> list[str]:
    if not arg:
        return [DEFAULT_PRESET if gpu else "small"]
    names = list(PRESETS) if arg.strip() == "all" else _split_list(arg)
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        raise ValueError(
            f"bench --preset: unknown preset {', '.join(map(repr, unknown)) or repr(arg)}; "
            f"expected one of {', '.join(PRESETS)} (comma-separated) or 'all'"
        )
    return names


def _shape_text(preset: Preset) -> str:
    tokens = sum(preset.lengths)
    segs = ", ".join(f"{n:,}" for n in preset.lengths)
    return f"segments [{segs}] = {tokens:,} tokens x {preset.heads} heads x {HEAD_DIM}"


def _peer_names() -> list[str]:
    from . import benchtools

    names = ["torch SDPA cuDNN bf16", "torch SDPA flash bf16"]
    if benchtools.sageattention_available():
        names.append("SageAttention")
    if benchtools.cudnn_frontend_available():
        names.append("cuDNN fp8 (kernel, fp8 out)")
    return names


KERNEL_ONLY_NOTE = "'kernel only': the pre-pass excluded"


@dataclass
class _Measurement:
    """One row of a preset: ``run()`` is what is timed, ``to_packed(run())`` the packed output
    that the accuracy column compares with the oracle. ``prime`` (untimed) runs right before
    this row's first call; ``check(output of the accuracy call)`` adds keys to the row, as
    ``fields`` does."""

    label: str
    run: Callable[[], Any]
    to_packed: Callable[[Any], Any]
    prime: Callable[[], None] | None = None
    check: Callable[[Any], dict[str, Any]] | None = None
    fields: dict[str, Any] = field(default_factory=dict)


def _bench_result(label: str, ms: float | None, flops: float, rel: float | None,
                  error: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": label,
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12 if ms else None,
        "rel_l2": rel,
    }
    if error is not None:
        row["error"] = error
    return row


def _versions() -> dict[str, str | None]:
    import torch

    from .jit import env

    versions: dict[str, str | None] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": None,
        "apache-tvm-ffi": env.tvm_ffi_version(),
    }
    try:
        cudnn = torch.backends.cudnn.version()
        versions["cudnn"] = str(cudnn) if cudnn else None
    except Exception:  # no cuDNN in a CPU build
        pass
    try:
        from importlib.metadata import version

        versions["sageattention"] = version("sageattention")
    except Exception:  # not installed
        pass
    return versions


def cmd_bench(args: argparse.Namespace) -> int:
    from . import benchtools

    ops = _split_list(args.op) if args.op else list(OPERATORS)
    for op in ops:
        if op not in OPERATORS:
            raise ValueError(
                f"bench --op: unknown operator {op!r}; expected {', '.join(OPERATORS)}"
            )
    if args.plot:
        benchtools.require_matplotlib()  # fail before measuring anything
    gpu = _has_gpu()
    names = _bench_presets(args.preset, gpu)
    if not gpu:
        return _bench_cpu(args, ops, names)
    return _bench_gpu(args, ops, names)


def _bench_cpu(args: argparse.Namespace, ops: list[str], names: list[str]) -> int:
    from . import benchtools

    impls = [f"flashinfer_h3 {op}" for op in ops] + _peer_names()
    _print(
        "bench: no CUDA GPU visible. On a GPU this command times "
        f"{', '.join(impls)} on preset(s) {', '.join(names if args.preset else [DEFAULT_PRESET])}"
        f"; for a kernel backend also its attention kernel alone ({KERNEL_ONLY_NOTE})."
    )
    too_big = [n for n in names if n != "small"]
    if too_big:
        shapes = "; ".join(f"{n}: {_shape_text(PRESETS[n])}" for n in too_big)
        raise ValueError(
            f"--preset {','.join(too_big)} {GPU_PRESET_NOTE} ({shapes}); the CPU reference would "
            "take hours. Without a GPU only --preset small runs (the torch reference of the "
            "recipes on the CPU)"
        )
    preset_name, preset = "small", PRESETS["small"]
    flops = attention_flops(preset.lengths, preset.heads)
    _print(
        f"bench: running the torch reference on the CPU instead, preset 'small': "
        f"{_shape_text(preset)}, one run each. CPU times say nothing about the kernels."
    )
    q, k, v, cu, bounds = _inputs(preset.lengths, preset.heads, "cpu", args.seed)
    oracle = benchtools.sampled_oracle(q, k, v, bounds, seed=args.seed)
    results: list[dict[str, Any]] = []
    for i, op in enumerate(ops, 1):
        label = f"{op} reference (CPU)"
        _print(f"  [{i}/{len(ops)}] {label}: running ...")
        start = time.perf_counter()
        out = _reference(op)(q, k, v, cu, cu_seqlens_host=bounds)
        ms = (time.perf_counter() - start) * 1e3
        row = _bench_result(label, ms, flops, oracle.rel_l2(out))
        results.append(row)
        _print(
            f"  [{i}/{len(ops)}] {label}: {ms:10.1f} ms  {flops / (ms * 1e-3) / 1e9:8.2f} GFLOP/s"
            f"  rel L2 vs FP32 oracle {row['rel_l2']:.4f} ({len(oracle.rows)} sampled rows)"
        )
    runs = [_run_record(preset_name, preset, results)]
    _write_outputs(args, "cpu", runs)
    return 0


def _run_record(name: str, preset: Preset, results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "preset": name,
        "about": preset.about,
        "lengths": list(preset.lengths),
        "heads": preset.heads,
        "flops": attention_flops(preset.lengths, preset.heads),
        "results": results,
    }


def _bench_gpu(args: argparse.Namespace, ops: list[str], names: list[str]) -> int:
    import torch

    from . import benchtools

    device = torch.device("cuda")
    gpu_name = torch.cuda.get_device_name(device)
    cap = torch.cuda.get_device_capability(device)
    impls = []
    for op in ops:
        impls.append(f"flashinfer_h3 {op}")
        prepared = benchtools.kernel_only_backend(op, device)
        if prepared is not None:
            impls.append(benchtools.kernel_only_label(op, prepared.name))
    impls += _peer_names()
    total = len(names) * len(impls)
    _print(
        f"bench on {gpu_name} (compute capability {cap[0]}.{cap[1]}): {len(names)} preset(s) x "
        f"{len(impls)} implementation(s) ({', '.join(impls)}); median of {args.iters} runs "
        f"after {args.warmup} warm-up{benchtools.warmup_note(vars(args))}"
        f"{benchtools.rounds_note(args.rounds)}, whole call "
        f"({KERNEL_ONLY_NOTE}); accuracy: relative L2 vs the FP32 oracle on up to "
        f"{benchtools.ROWS_PER_SEGMENT} sampled rows per segment"
    )
    runs: list[dict[str, Any]] = []
    progress = [0, total]
    for preset_name in names:
        runs.append(_bench_gpu_preset(args, ops, preset_name, progress))
        torch.cuda.empty_cache()
    _write_outputs(args, gpu_name, runs)
    return 0


def _bench_gpu_preset(args: argparse.Namespace, ops: list[str], preset_name: str,
                      progress: list[int]) -> dict[str, Any]:
    """Every implementation on one preset; ``progress`` = [measurements done, total]."""
    import torch
    from torch.nn.attention import SDPBackend

    from . import benchtools

    preset = PRESETS[preset_name]
    flops = attention_flops(preset.lengths, preset.heads)
    _print(f"preset {preset_name!r}: {preset.about}; {_shape_text(preset)}")
    q, k, v, cu, bounds = _inputs(preset.lengths, preset.heads, torch.device("cuda"), args.seed)
    oracle = benchtools.sampled_oracle(q, k, v, bounds, seed=args.seed)
    out = torch.empty_like(q)
    rows: list[_Measurement] = []
    for op in ops:
        fn = _operator(op)
        rows.append(_Measurement(
            f"flashinfer_h3 {op} [{_backend_label(op)}]",
            lambda fn=fn: fn(q, k, v, cu, out, cu_seqlens_host=bounds),
            lambda result: result,
            fields={"op": op, "scope": benchtools.WHOLE_CALL},
        ))
        # The attention kernel alone (kernel backends only), right after the whole call: one
        # untimed whole call with the same plan and workspace, then only the attention kernel.
        kernel = benchtools.kernel_only_peer(op, q, k, v, bounds, out)
        if kernel is not None:
            rows.append(_Measurement(
                kernel.label, kernel.run, lambda result: result, prime=kernel.prime,
                check=lambda result, kernel=kernel: {
                    "matches_whole_call": kernel.matches_whole_call(result)},
                fields={"op": op, "scope": benchtools.KERNEL_ONLY, "backend": kernel.backend},
            ))
    for label, backend in (("torch SDPA cuDNN bf16", SDPBackend.CUDNN_ATTENTION),
                           ("torch SDPA flash bf16", SDPBackend.FLASH_ATTENTION)):
        rows.append(_Measurement(label, *benchtools.sdpa_peer(q, k, v, bounds, backend)))
    if benchtools.sageattention_available():
        rows.append(_Measurement("SageAttention",
                                 *benchtools.sageattention_peer(q, k, v, bounds)))
    if benchtools.cudnn_frontend_available():
        try:
            fp8_peer = benchtools.cudnn_fp8_peer(q, k, v, bounds)
            rows.append(_Measurement("cuDNN fp8 (kernel, fp8 out)", *fp8_peer))
        except Exception as exc:  # graph build: an unsupported shape or cuDNN version
            _print(f"  cuDNN fp8 peer unavailable: {type(exc).__name__}: {str(exc)[:160]}")
    results: list[dict[str, Any]] = []
    timings: list[list[float]] = []  # per row, one median per round
    states: list[list[Any]] = []  # per row, the GPU's state in each round (None: no nvidia-smi)
    for m in rows:
        progress[0] += 1
        step = f"[{progress[0]}/{progress[1]}] {preset_name} {m.label}"
        try:
            if m.prime is not None:
                m.prime()
            result = m.run()  # one untimed call: the accuracy column
            rel = oracle.rel_l2(m.to_packed(result))
            extra = m.check(result) if m.check is not None else {}
            ms, state = _timed(m.run, args.iters, args.warmup, args.warmup_ms)
            row = _bench_result(m.label, ms, flops, rel)
            note = "" if extra.get("matches_whole_call", True) else (
                " (WARNING: its output differs from the whole call's)")
            _print(f"  {step}: {ms:.3f} ms, {row['tflops']:.1f} TFLOP/s, rel L2 {rel:.4f}"
                   f"{_state_text(state)}{note}")
            timings.append([ms])
        except Exception as exc:  # a peer backend may be unavailable on this build/GPU
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            row, extra, state = _bench_result(m.label, None, flops, None, error), {}, None
            _print(f"  {step}: n/a ({error})")
            timings.append([])
        states.append([state])
        row.update(m.fields)
        row.update(extra)
        results.append(row)
    # Further rounds time every row again in turn, so that the GPU's warming and its clock under
    # the power cap fall on every implementation alike; a row's time is its rounds' median.
    # Round r's order (benchtools.round_order): no row always follows the same one.
    for r in range(1, args.rounds):
        for i in benchtools.round_order(len(rows), r):
            m, row, times, seen = rows[i], results[i], timings[i], states[i]
            if row["ms"] is None:
                continue
            if m.prime is not None:
                m.prime()  # another row's call may have reused the workspace
            ms, state = _timed(m.run, args.iters, args.warmup, args.warmup_ms)
            times.append(ms)
            seen.append(state)
            _print(f"  round {r + 1}/{args.rounds} {preset_name} {m.label}: {ms:.3f} ms"
                   f"{_state_text(state)}")
    for row, times, seen in zip(results, timings, states, strict=True):
        if times:
            row.update(_bench_result(row["name"], statistics.median(times), flops, row["rel_l2"]))
            row["round_ms"] = times
        if all(st is not None for st in seen):
            row["gpu"] = {key: statistics.median(getattr(st, key) for st in seen)
                          for key in ("sm_clock_mhz", "power_w", "temperature_c")}
    _print_table(results)
    return _run_record(preset_name, preset, results)


def _print_table(results: list[dict[str, Any]]) -> None:
    peers = {r["name"]: r["ms"] for r in results}
    cudnn, flash = peers.get("torch SDPA cuDNN bf16"), peers.get("torch SDPA flash bf16")
    w = max([24] + [len(r["name"]) for r in results])
    _print(
        f"  {'':{w}s} {'ms':>9s} {'TFLOP/s':>9s} {'x cuDNN':>8s} {'x flash':>8s} {'rel L2':>8s}"
    )
    for r in results:
        if r["ms"] is None:
            _print(f"  {r['name']:{w}s} n/a ({r['error']})")
            continue
        r["vs_cudnn"] = cudnn / r["ms"] if cudnn else None
        r["vs_flash"] = flash / r["ms"] if flash else None
        ratio = "  ".join(
            f"{x:8.2f}" if x else f"{'n/a':>8s}" for x in (r["vs_cudnn"], r["vs_flash"])
        )
        _print(f"  {r['name']:{w}s} {r['ms']:9.3f} {r['tflops']:9.1f} {ratio} {r['rel_l2']:8.4f}")
    for line in _prepass_lines(results):
        _print(line)


def _prepass_lines(results: list[dict[str, Any]]) -> list[str]:
    """Per operator with both measurements: what the whole call spends beyond the kernel."""
    from .benchtools import KERNEL_ONLY, WHOLE_CALL

    lines = []
    for kernel in results:
        if kernel.get("scope") != KERNEL_ONLY or not kernel.get("ms"):
            continue
        whole = next((r for r in results if r.get("scope") == WHOLE_CALL
                      and r.get("op") == kernel["op"] and r.get("ms")), None)
        if whole is None:
            continue
        extra = whole["ms"] - kernel["ms"]
        line = (
            f"  {kernel['op']} [{kernel['backend']}]: the whole call takes {whole['ms']:.3f} ms, "
            f"its attention kernel {kernel['ms']:.3f} ms: pre-pass and host work {extra:.3f} ms "
            f"({100 * extra / whole['ms']:.0f}% of the call)"
        )
        # Two rows timed at different moments: under the power cap the clock moves between them,
        # and the difference of their medians holds that drift too (it has come out negative).
        # With rounds, the per-round differences show how far to trust it.
        whole_rounds, kernel_rounds = whole.get("round_ms") or [], kernel.get("round_ms") or []
        if len(whole_rounds) > 1 and len(whole_rounds) == len(kernel_rounds):
            diffs = sorted(w - k for w, k in zip(whole_rounds, kernel_rounds, strict=True))
            line += (f"; round by round {diffs[0]:.3f} to {diffs[-1]:.3f} ms (the clock's drift "
                     "between the two rows included)")
        lines.append(line)
    return lines


def _write_outputs(args: argparse.Namespace, device: str, runs: list[dict[str, Any]]) -> None:
    import datetime

    payload: dict[str, Any] = {
        "flashinfer_h3": __version__,
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        # What ran: the CPU reference runs each op once, whatever the timing options said.
        "iters": 1 if device == "cpu" else args.iters,
        "warmup": 0 if device == "cpu" else args.warmup,
        "warmup_ms": 0.0 if device == "cpu" else args.warmup_ms,
        "rounds": 1 if device == "cpu" else args.rounds,
        "seed": args.seed,
        "runs": runs,
    }
    if len(runs) == 1:  # one preset: its fields at the top level too
        payload.update({k: v for k, v in runs[0].items() if k != "about"})
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
        _print(f"bench: results written to {args.json}")
    if args.plot:
        from . import benchtools

        benchtools.plot(payload, args.plot)
        _print(f"bench: plot written to {args.plot}")


# ---------------------------------------------------------------------------------------------


DESCRIPTION = "flashinfer_h3: NVFP4 / FP8 packed-varlen attention for MiniMax-H3."
EPILOG = """Without a GPU: info, warmup --arch, check (the reference against the oracle) and bench
(the small preset on the reference) still work.
Run "python -m flashinfer_h3 COMMAND --help" for a command's options."""
BENCH_EPILOG = """presets:
""" + "\n".join(f"  {name:11s} {preset.about}" for name, preset in PRESETS.items()) + """

Each measurement is the median of --iters timed calls (CUDA events, whole call) after --warmup
untimed ones and as many more as fill --warmup-ms (with --rounds N, every row of a preset is
timed again in turn N - 1 times, each round starting at another row, and reports its rounds'
median; the SM clock, power and temperature nvidia-smi sampled meanwhile go
into the JSON's "gpu" field), with the relative L2 error against the FP32 oracle on sampled
rows. A kernel backend gets a second row, "kernel only (no pre-pass)": its attention kernel
alone, timed after one whole call has left that input's quantized operands in the workspace;
its accuracy comes from the kernel-only output. TFLOP/s = 4 * sum(L^2) * heads * 128 / time.
Optional peers (SageAttention, cuDNN FP8) and --plot need the bench extra:
pip install 'flashinfer-h3[bench]'."""


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="python -m flashinfer_h3", description=DESCRIPTION, epilog=EPILOG, formatter_class=raw
    )
    parser.add_argument("--version", action="version", version=f"flashinfer_h3 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    about = "versions, GPU and arch, nvcc, cache, prebuilt kernels"
    p = sub.add_parser("info", help=about, description=f"Print {about}, and the backend each "
                       "operator runs on (a kernel or the torch emulation).")
    p.add_argument("--arch", help="show the backends for these targets, e.g. sm_90a,sm_120a "
                   "(default: the visible GPUs, else FLASHINFER_H3_CUDA_ARCH_LIST)")
    about = "build the kernels ahead of time (no GPU needed with --arch)"
    p = sub.add_parser("warmup", help=about, description="Compile and cache every kernel "
                       "module for the chosen architectures (no GPU needed with --arch).")
    p.add_argument(
        "--arch",
        help="comma-separated targets, e.g. sm_90a,sm_120a "
        "(default: FLASHINFER_H3_CUDA_ARCH_LIST, else the visible GPUs)",
    )
    p.add_argument("--op", help="comma-separated ops among utils,nvfp4,fp8 (default: all)")
    about = "run each operator on a small input against the references"
    p = sub.add_parser("check", help=about, description="Run each operator on a small random "
                       "input and compare it with the reference and the FP32 oracle (without a "
                       "GPU: the reference against the oracle).")
    p.add_argument("--op", help="comma-separated operators among nvfp4,fp8 (default: both)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random inputs (default: %(default)s)")
    about = "time the operators on MiniMax-H3 shapes against PyTorch SDPA"
    p = sub.add_parser("bench", help=about, epilog=BENCH_EPILOG, formatter_class=raw,
                       description="Time the operators on MiniMax-H3 shapes against PyTorch's "
                       "cuDNN and flash BF16 attention\n(and SageAttention when installed), "
                       "measured in the same process; print a table, optionally\nwrite JSON and "
                       "a PNG plot. Without a GPU: only the small preset, on the torch reference.")
    p.add_argument(
        "--preset",
        help=f"comma-separated presets among {', '.join(PRESETS)}, or 'all' (default: "
        f"{DEFAULT_PRESET}; 'small' without a GPU, where the others are refused)",
    )
    p.add_argument("--op", help="comma-separated operators among nvfp4,fp8 (default: both)")
    p.add_argument("--iters", type=_positive_int, default=10,
                   help="timed calls per measurement, >= 1; the median is reported "
                   "(default: %(default)s)")
    p.add_argument("--warmup", type=_non_negative_int, default=2,
                   help="untimed calls before timing, >= 0 (default: %(default)s)")
    p.add_argument("--warmup-ms", type=_non_negative_float, default=1000.0,
                   help="then more untimed calls until this many milliseconds have passed, so "
                   "that each row is timed at its own clock under the power cap rather than at "
                   "the previous row's (default: %(default)s)")
    p.add_argument("--rounds", type=_positive_int, default=1,
                   help="rounds, >= 1: each round times every implementation of a preset in "
                   "turn (--iters calls each), a row reports its rounds' median (default: "
                   "%(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random inputs and of the sampled oracle rows "
                   "(default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw TFLOP/s and time per implementation per preset into this "
                   "PNG (needs matplotlib: the bench extra)")
    return parser


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "info": cmd_info,
    "warmup": cmd_warmup,
    "check": cmd_check,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    from .jit.env import JitError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, JitError) as exc:
        # Usage and environment problems (unknown arch, no GPU and no --arch, no nvcc): one
        # clear line instead of a traceback.
        print(f"python -m flashinfer_h3 {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
