"""What the quantisation pre-pass costs on a few SMs, and beside the attention kernel.

Issues 11 and 12 fall short on h3-mix, where the pre-pass weighs most: it is DRAM-bound over the
whole GPU (~1.5 ms FP8, ~1.8 ms NVFP4 at 61k tokens x 56 heads on an H200, 2.0-2.3 ms on an
H100) and adds 2-3.5 % to a call whose attention is only a third of h3-10s's. The attention
kernel leaves DRAM nearly idle, so the pre-pass could run beside it, on a few SMs, if a few SMs
do it at a much higher rate per SM than all of them do. This benchmark measures that rate
before anything is built around it (benchmarks/RESULTS.md, nineteenth session: they do not).

Rows, per op and shape (median of CUDA-event timings over ``--rounds`` rounds of ``--iters``
calls, every row timed in turn in each round):

- ``pre-pass, every CTA``: the production build's three launches (two CTAs an SM), T_full, and
  its SM time T_full x SMs;
- ``pre-pass, N CTAs``: a benchmark build whose tile launches (1 and 3) take at most N CTAs
  (KernelConfig flag ``prepass_ctas``), T_N, and its SM time T_N x min(N, SMs) (the block
  scheduler puts one CTA on each of N SMs first); the ratio of the SM times is what running it
  on N SMs saves per SM;
- ``attention alone``: the production attention kernel on operands the pre-pass wrote, A;
- ``attention + N-CTA pre-pass beside it``: the same kernel with the N-CTA build's pre-pass of a
  second workspace on a side stream, launched first, C_N. C_N - A is what that pre-pass cost the
  attention kernel, against T_full when the two run one after the other. (The pre-pass's launch
  2 has no CTA cap, and the SMs of a finished launch 1 go to waiting attention CTAs, so this is
  an upper bound on what a single persistent pre-pass launch beside the kernel would cost.)

    python benchmarks/bench_prepass_sms.py [--op nvfp4,fp8] [--preset h3-mix,h3-10s]
        [--ctas 8,16,32,64] [--iters 5] [--rounds 3] [--build-only]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from bench_wgmma_variants import MODULES  # (module, backend) of each op: this directory's script

from flashinfer_h3 import backends
from flashinfer_h3.__main__ import PRESETS, _time_cuda
from flashinfer_h3.benchtools import KernelOnly
from flashinfer_h3.jit import KernelConfig, build_module
from flashinfer_h3.jit.load import load_so


def _kernel_only(op: str, flags: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, bounds: tuple[int, ...]) -> KernelOnly:
    """A primed KernelOnly of ``op``'s build with ``flags``, on the current stream's workspace."""
    module_name, backend_name = MODULES[op]
    backend = backends.get(op, backend_name)
    module = load_so(build_module(KernelConfig(module_name, arch="sm_90a", flags=flags)))
    prepared = backends.Prepared(backend, backend.make_launcher(module, backend), q.device)
    ko = KernelOnly(op, prepared, q, k, v, out, bounds, 128**-0.5)
    ko.prime()
    return ko


def _prepass(ko: KernelOnly) -> Callable[[], None]:
    launch = ko.prepared.launch
    return lambda: launch.prepass_only(ko.q, ko.k, ko.v, ko.out, ko.scale, ko.bounds, ko.plan,
                                       ko.views)


def _beside(attention: KernelOnly, prepass: Callable[[], None], side: torch.cuda.Stream
            ) -> Callable[[], None]:
    """The side stream's pre-pass launched first, then the attention kernel on the current
    stream; the current stream waits for both."""

    def run() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prepass()
        attention.run()
        main.wait_stream(side)

    return run


def run(op: str, preset: str, caps: list[int], iters: int, rounds: int) -> None:
    p = PRESETS[preset]
    bounds = tuple(int(x) for x in torch.tensor((0, *p.lengths)).cumsum(0).tolist())
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(bounds[-1], p.heads, 128, generator=g, device="cuda").bfloat16()
               for _ in range(3))
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    production = _kernel_only(op, {}, q, k, v, out, bounds)
    rows: list[tuple[str, Callable[[], None], int]] = [
        ("pre-pass, every CTA", _prepass(production), sms),
        ("attention alone", production.run, 0),
    ]
    side_out = torch.empty_like(q)
    for n in caps:
        with torch.cuda.stream(side):  # its own workspace (one per device and stream)
            capped = _kernel_only(op, {"prepass_ctas": n}, q, k, v, side_out, bounds)
        torch.cuda.synchronize()
        rows.append((f"pre-pass, {n} CTAs", _prepass(capped), min(n, sms)))
        beside = _beside(production, _prepass(capped), side)
        rows.append((f"attention + {n}-CTA pre-pass beside it", beside, 0))
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _ in range(rounds):
        for name, fn, _ in rows:
            times[name].append(_time_cuda(fn, iters, 2))
    ms = {name: statistics.median(t) for name, t in times.items()}
    full, alone = ms["pre-pass, every CTA"], ms["attention alone"]
    print(f"{op} {preset} ({bounds[-1]} x {p.heads}), {sms} SMs, {torch.cuda.get_device_name()}:")
    for name, _, used in rows:
        t = ms[name]
        spread = (max(times[name]) - min(times[name])) / t
        extra = ""
        if used:
            share = t * used / (full * sms)
            extra = f", SM time {t * used:.1f} SM-ms ({share:.2f} x every CTA's)"
        elif name != "attention alone":
            extra = f", +{t - alone:.3f} ms over the attention alone (pre-pass alone {full:.3f} ms)"
        print(f"  {name}: {t:.3f} ms (rounds spread {100 * spread:.1f} %){extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="nvfp4,fp8", help="comma-separated among nvfp4, fp8")
    ap.add_argument("--preset", default="h3-mix",
                    help=f"comma-separated among {', '.join(PRESETS)}")
    ap.add_argument("--ctas", default="8,16,32,64", help="comma-separated CTA caps of the pre-pass")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build-only", action="store_true",
                    help="compile the builds into the JIT cache and exit (no GPU needed)")
    args = ap.parse_args()
    ops = args.op.split(",")
    for op in ops:
        if op not in MODULES:
            ap.error(f"--op: unknown op {op!r}; expected nvfp4 or fp8")
    try:
        caps = [int(x) for x in args.ctas.split(",")]
    except ValueError:
        ap.error(f"--ctas: expected comma-separated integers, got {args.ctas!r}")
    if any(n < 1 for n in caps):
        ap.error(f"--ctas: each cap must be >= 1, got {args.ctas!r}")
    if args.iters < 1 or args.rounds < 1:
        ap.error(f"--iters and --rounds must be >= 1, got {args.iters} and {args.rounds}")
    presets = args.preset.split(",")
    for preset in presets:
        if preset not in PRESETS:
            ap.error(f"--preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if args.build_only:
        for op in ops:
            for flags in [{}] + [{"prepass_ctas": n} for n in caps]:
                config = KernelConfig(MODULES[op][0], arch="sm_90a", flags=flags)
                print(op, flags, build_module(config))
        return
    for preset in presets:
        for op in ops:
            run(op, preset, caps, args.iters, args.rounds)


if __name__ == "__main__":
    main()
