"""Joules a call: each operator's whole call, its pre-pass and its attention kernel alone, benchmark
builds of the Hopper kernels, and cuDNN BF16, from the GPU's own energy counter.

Why: on the H100 and H200 the low-precision kernels and cuDNN BF16 all run at the 700 W board power
cap, where the SM clock follows the power. There a call's time is what its energy allows, and a
change that saves cycles but not energy gains back less than its cycles (the clock drops), while one
that saves energy gains even where its cycles do not move (benchmarks/RESULTS.md, twenty-fourth
session). The ratio the issues' bars name, cuDNN BF16's time over ours, is then close to the ratio
of the energies a call.

Each row runs its calls back to back (a synchronize after each) for at least ``--seconds`` from
an update of NVML's total energy counter to its next update after the last call
(benchtools.energy_per_call), in ``--rounds`` rounds that take every row in turn. Per row it
prints the round with the median joules a call: milliseconds a call (wall clock of the calls and
the gaps between them), joules a call (with the idle tail to the counter's next update, under 1 %
of a window of seconds), the mean power over the calls, and cuDNN BF16's joules and milliseconds
over the row's (not for the pre-pass rows, a part of a call).

    python benchmarks/bench_energy.py [--op fp8,nvfp4] [--preset h3-10s,h3-mix] [--shape 333*184:56]
        [--seconds 4] [--rounds 2] [--fp8-build kv_copies=0] [--nvfp4-build delta=0]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from flashinfer_h3 import benchtools
from flashinfer_h3.__main__ import PRESETS, _inputs, _operator  # the bench command's


def _label(op: str, flags: dict[str, int]) -> str:
    return f"{op} [" + ",".join(f"{key}={val}" for key, val in flags.items()) + "] kernel alone"


def run(name: str, lengths: tuple[int, ...], heads: int, ops: list[str], seconds: float,
        rounds: int, builds: list[tuple[str, dict[str, int]]], meter: benchtools.EnergyCounter
        ) -> None:
    q, k, v, cu, bounds = _inputs(lengths, heads, torch.device("cuda"), 0)
    out = torch.empty_like(q)
    # (row, function, the kernel-only measurement to prime before it, or None)
    rows: list[tuple[str, Callable[[], Any], benchtools.KernelOnly | None]] = []
    for op in ops:
        ko = benchtools.kernel_only_peer(op, q, k, v, bounds, out)
        if ko is None:
            print(f"{op}: no kernel backend on this GPU; skipped")
            continue
        fn = _operator(op)
        rows.append((f"{op} whole call",
                     lambda fn=fn: fn(q, k, v, cu, out, cu_seqlens_host=bounds), ko))
        args = lambda ko=ko: (q, k, v, out, ko.scale, ko.bounds, ko.plan, ko.views)  # noqa: E731
        rows.append((f"{op} pre-pass alone",
                     lambda ko=ko, args=args: ko.prepared.launch.prepass_only(*args()), ko))
        rows.append((f"{op} kernel alone", ko.run, ko))
    if builds and torch.cuda.get_device_capability()[0] != 9:
        print("--fp8-build / --nvfp4-build: Hopper (compute capability 9.0) modules; skipped")
    else:
        for op, flags in builds:
            ko = benchtools.kernel_only_build(op, flags, q, k, v, bounds, out)
            rows.append((_label(op, flags), ko.run, ko))
    cudnn, _ = benchtools.sdpa_peer(q, k, v, bounds, SDPBackend.CUDNN_ATTENTION)
    rows.append(("cuDNN bf16", cudnn, None))
    measured: dict[str, list[benchtools.EnergyPerCall]] = {}
    for r in range(rounds):
        for row, fn, ko in rows:
            if ko is not None:
                ko.prime()  # this input's operands in the workspace (other rows reuse it)
            window = benchtools.energy_per_call(fn, meter, seconds, torch.cuda.synchronize)
            if window is None:
                raise SystemExit("bench_energy: the GPU's energy counter did not update (NVML)")
            measured.setdefault(row, []).append(window)
            print(f"  round {r + 1}/{rounds} {name} {row}: {window.calls} calls, "
                  f"{window.ms_per_call:.3f} ms, {window.joules_per_call:.2f} J a call, "
                  f"{window.watts:.0f} W", flush=True)
    median = {row: median_window(windows) for row, windows in measured.items()}
    yard = median["cuDNN bf16"]
    print(f"{name} ({sum(lengths)} tokens x {heads} heads), the median-joules round of "
          f"{rounds}, >= {seconds:g} s each:")
    print(f"  {'row':64s} {'ms':>9s} {'J':>8s} {'W':>5s}  cuDNN bf16 / this: J, ms")
    for row, w in median.items():
        ratios = ""
        if "pre-pass" not in row:
            ratios = (f"  {yard.joules_per_call / w.joules_per_call:6.3f} "
                      f"{yard.ms_per_call / w.ms_per_call:6.3f}")
        spread = [x.joules_per_call for x in measured[row]]
        print(f"  {row:64s} {w.ms_per_call:9.3f} {w.joules_per_call:8.2f} {w.watts:5.0f}{ratios}"
              f"  (J over rounds {min(spread):.2f}-{max(spread):.2f})", flush=True)


def median_window(windows: list[benchtools.EnergyPerCall]) -> benchtools.EnergyPerCall:
    """The window with the median joules a call (the lower middle one of an even count): its
    milliseconds, joules and watts come from one run, so they agree with each other."""
    ordered = sorted(windows, key=lambda w: w.joules_per_call)
    return ordered[(len(ordered) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="fp8,nvfp4", help="comma-separated among nvfp4, fp8")
    ap.add_argument("--preset", default="h3-10s,h3-mix",
                    help=f"comma-separated among {', '.join(PRESETS)}")
    ap.add_argument("--shape", action="append", default=[], metavar="LENGTHS:HEADS",
                    help="also a shape of its own, e.g. 333*184:56; repeatable")
    ap.add_argument("--seconds", type=float, default=4.0,
                    help="the least length of a row's energy window (the counter updates every "
                    "20-100 ms)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each takes every row in turn")
    for op in ("fp8", "nvfp4"):
        ap.add_argument(f"--{op}-build", action="append", default=[], metavar="FLAG=VALUE,...",
                        help=f"also the kernel alone of a benchmark build of the {op} Hopper "
                        "module with these KernelConfig flags (integers), e.g. kv_copies=0; "
                        "repeatable")
    args = ap.parse_args()
    if not math.isfinite(args.seconds) or args.seconds <= 0 or args.rounds < 1:
        ap.error("--seconds must be > 0 and --rounds >= 1")
    builds: list[tuple[str, dict[str, int]]] = []
    for op in ("fp8", "nvfp4"):
        for spec in getattr(args, f"{op}_build"):
            try:
                flags = benchtools.parse_build_flags(spec, op)
            except ValueError as e:
                ap.error(f"--{op}-build: {e}")
            if flags and (op, flags) not in builds:
                builds.append((op, flags))
    try:
        shapes = benchtools.bench_shapes(args.preset, args.shape, PRESETS)
    except ValueError as e:
        ap.error(str(e))
    ops = list(dict.fromkeys(op.strip() for op in args.op.split(",") if op.strip()))
    for op in ops:
        if op not in benchtools.HOPPER_MODULES:
            ap.error(f"--op: unknown op {op!r}; expected nvfp4 or fp8")
    if not torch.cuda.is_available():
        raise SystemExit("bench_energy: needs a CUDA GPU")
    meter = benchtools.EnergyMeter(torch.cuda.current_device())
    if meter.read() is None:
        raise SystemExit("bench_energy: NVML's energy counter cannot be read on this machine "
                         "(libnvidia-ml.so.1 and a Volta or later GPU are needed)")
    try:
        for name, lengths, heads in shapes:
            run(name, lengths, heads, ops, args.seconds, args.rounds, builds, meter)
    finally:
        meter.close()


if __name__ == "__main__":
    main()
