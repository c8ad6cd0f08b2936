"""Where a whole call's time goes, per operator and preset: the pre-pass and the attention kernel,
each timed back to back on its own and both inside one call sequence, beside the whole call.

Rows (median of CUDA-event timings over ``--rounds`` rounds of ``--iters`` calls; every row of a
preset is timed in turn in each round, so the GPU's warming and its clock under the power cap fall
on all of them alike):

- ``whole call``: the public operator, as ``python -m flashinfer_h3 bench`` times it;
- ``pre-pass alone``: the quantisation launches (``launch.prepass_only``) back to back;
- ``kernel alone``: the attention kernel (``launch.attention_only``) back to back, as the bench's
  "kernel only" row;
- ``in call: pre-pass`` / ``in call: kernel``: one event between the two halves of each call,
  so each part is timed where it runs in a real call (after the other one); ``in call: both``:
  the two halves' sum per call (the whole call less its host work: the row to compare between
  production and a benchmark build, which has no public operator);
- ``cuDNN bf16``: torch SDPA's cuDNN backend, the bar's yardstick.

``--fp8-build FLAG=VALUE,...`` (repeatable) adds the same rows but the whole call's for a
benchmark build of the Hopper FP8 module (KernelConfig flags, e.g. ``q_in_kernel=1``: its
pre-pass without Q and its kernel quantising Q), so its pre-pass, kernel and in-call split sit
beside production's. ``--shape LENGTHS:HEADS``
(repeatable) adds shapes beside the presets.

    python benchmarks/bench_call_breakdown.py [--op fp8,nvfp4] [--preset h3-10s,h3-mix]
        [--shape 333*184:56] [--iters 10] [--rounds 3] [--warmup-ms 1000]
        [--fp8-build q_in_kernel=1 [--fp8-build q_in_kernel=2]]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from flashinfer_h3 import benchtools
from flashinfer_h3.__main__ import (  # the bench command's
    PRESETS,
    _inputs,
    _non_negative_float,
    _operator,
    _time_cuda,
)


def _split(launch: Any, args: tuple[Any, ...], iters: int, warmup: int
           ) -> tuple[list[float], list[float]]:
    """(pre-pass, kernel) ms of each call of a sequence pre-pass -> event -> kernel."""
    for _ in range(warmup):
        launch.prepass_only(*args)
        launch.attention_only(*args)
    torch.cuda.synchronize()
    pre, ker = [], []
    for _ in range(iters):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        launch.prepass_only(*args)
        e[1].record()
        launch.attention_only(*args)
        e[2].record()
        e[2].synchronize()
        pre.append(e[0].elapsed_time(e[1]))
        ker.append(e[1].elapsed_time(e[2]))
    return pre, ker


def run(name: str, lengths: tuple[int, ...], heads: int, ops: list[str], iters: int, rounds: int,
        fp8_builds: list[dict[str, Any]] | None = None, warmup_ms: float = 1000.0) -> None:
    q, k, v, cu, bounds = _inputs(lengths, heads, torch.device("cuda"), 0)
    out = torch.empty_like(q)
    rows: dict[str, list[float]] = {}
    cudnn, _ = benchtools.sdpa_peer(q, k, v, bounds, SDPBackend.CUDNN_ATTENTION)
    peers = []  # (op, public operator, kernel-only peer) of each op with a kernel backend here
    for op in ops:
        ko = benchtools.kernel_only_peer(op, q, k, v, bounds, out)
        if ko is None:
            print(f"{op}: no kernel backend on this GPU; skipped")
        else:
            peers.append((op, _operator(op), ko))
    if fp8_builds and torch.cuda.get_device_capability()[0] != 9:
        print("--fp8-build: the fp8_wgmma module is a Hopper (compute capability 9.0) module; "
              "skipped")
    elif fp8_builds:
        for flags in fp8_builds:
            label = "fp8 [" + ",".join(f"{key}={val}" for key, val in flags.items()) + "]"
            build = benchtools.kernel_only_build("fp8", flags, q, k, v, bounds, out)
            peers.append((label, None, build))
    for r in range(rounds):
        for op, fn, ko in peers:
            ko.prime()  # the other op's calls may have reused the workspace
            launch = ko.prepared.launch
            args = (q, k, v, out, ko.scale, ko.bounds, ko.plan, ko.views)
            if fn is not None:  # a benchmark build has no public operator
                rows.setdefault(f"{op} whole call", []).append(
                    _time_cuda(lambda fn=fn: fn(q, k, v, cu, out, cu_seqlens_host=bounds), iters,
                               2, warmup_ms))
            rows.setdefault(f"{op} pre-pass alone", []).append(
                _time_cuda(lambda launch=launch, args=args: launch.prepass_only(*args), iters, 2))
            # The workspace holds this input's operands (the pre-pass just ran): the kernel alone.
            rows.setdefault(f"{op} kernel alone", []).append(
                _time_cuda(ko.run, iters, 2, warmup_ms))
            pre, ker = _split(launch, args, iters, 2)
            rows.setdefault(f"{op} in call: pre-pass", []).append(statistics.median(pre))
            rows.setdefault(f"{op} in call: kernel", []).append(statistics.median(ker))
            rows.setdefault(f"{op} in call: both", []).append(
                statistics.median([a + b for a, b in zip(pre, ker, strict=True)]))
        rows.setdefault("cuDNN bf16", []).append(_time_cuda(cudnn, iters, 2, warmup_ms))
        print(f"{name}: round {r + 1}/{rounds} done", flush=True)
    yardstick = statistics.median(rows["cuDNN bf16"])
    print(f"{name} ({sum(lengths)} tokens x {heads} heads), median of "
          f"{rounds} rounds x {iters} calls:")
    for row, times in rows.items():
        ms = statistics.median(times)
        spread = 100 * (max(times) - min(times)) / ms
        print(f"  {row:42s} {ms:9.3f} ms (rounds spread {spread:4.1f} %)  "
              f"cuDNN bf16 / this {yardstick / ms:6.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="fp8,nvfp4", help="comma-separated among nvfp4, fp8")
    ap.add_argument("--preset", default="h3-10s,h3-15s-sp4,h3-mix",
                    help=f"comma-separated among {', '.join(PRESETS)}")
    ap.add_argument("--shape", action="append", default=[], metavar="LENGTHS:HEADS",
                    help="also a shape of its own, e.g. 333*184:56 (184 segments of 333 tokens, "
                    "56 heads); repeatable")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per row and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each times every row in turn")
    ap.add_argument("--warmup-ms", type=_non_negative_float, default=1000.0,
                    help="untimed calls for this long before the whole-call, kernel-alone and "
                    "cuDNN rows (the bench command's --warmup-ms: each row nearer its own clock "
                    "under the power cap)")
    ap.add_argument("--fp8-build", action="append", default=[], metavar="FLAG=VALUE,...",
                    help="also a benchmark build of module fp8_wgmma with these KernelConfig "
                    "flags (integer values), e.g. q_in_kernel=1; repeatable")
    args = ap.parse_args()
    fp8_builds: list[dict[str, Any]] = []
    for spec in args.fp8_build:
        try:
            flags: dict[str, Any] = benchtools.parse_build_flags(spec, "fp8")
        except ValueError as e:
            ap.error(f"--fp8-build: {e}")
        if flags and flags not in fp8_builds:  # a repeated build would merge into one row
            fp8_builds.append(flags)
    try:
        shapes = benchtools.bench_shapes(args.preset, args.shape, PRESETS)
    except ValueError as e:
        ap.error(str(e))
    ops = [op.strip() for op in args.op.split(",")]
    for name, lengths, heads in shapes:
        run(name, lengths, heads, ops, args.iters, args.rounds, fp8_builds, args.warmup_ms)


if __name__ == "__main__":
    main()
