"""How much of a just-read buffer a second read finds in L2, by buffer size: the number that
decides the "single pass over K and V" pre-pass lever (issues 11 and 12).

The pre-pass reads k and v twice (launch 1 for the segment statistics, launch 3 for the codes,
templates/include/quantize/launch.cuh). A single persistent launch could quantise each (segment,
head) right after its statistics, so that the second read comes from L2, but only if L2 keeps
about one group's K and V (BF16: 15.7 MB for a 30,720-token segment, 31.5 MB for 61,440 tokens)
while the next group streams past. This script measures that directly: for each size it times a
read of a fresh buffer (cold: a 512 MB sweep evicts L2 first) and a read of the same buffer right
after a first read (warm), optionally with ``--between MB`` of other traffic in between (the
next group's statistics read). The saving of a warm read is what the second pass would save.
Sizes are MiB; the launch and event overhead (a read of 4 KiB, printed first) is subtracted,
since a read of a few MiB takes only microseconds.

    python benchmarks/bench_l2_reuse.py [--sizes 4,8,16,24,32,48,64] [--between 0,16]
        [--iters 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch

MB = 1 << 20


def _read(x: torch.Tensor) -> torch.Tensor:
    # One streaming read of every byte (a reduction writes almost nothing back).
    return x.view(torch.int32).sum(dtype=torch.int64)


def time_read(x: torch.Tensor, before: list[torch.Tensor], sweep: torch.Tensor) -> float:
    """ms of one read of ``x`` after an L2-evicting sweep and then reads of ``before``."""
    _read(sweep)
    for b in before:
        _read(b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _read(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def overhead_ms(sweep: torch.Tensor, iters: int) -> float:
    """ms of a read of 4 KiB: the launch and event cost included in every timing."""
    tiny = torch.ones(1024, dtype=torch.int32, device=sweep.device)
    return statistics.median(time_read(tiny, [], sweep) for _ in range(iters))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,8,16,24,32,48,64", help="buffer sizes in MiB")
    ap.add_argument("--between", default="0,16",
                    help="MiB of other reads between the first and the timed read")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    betweens = [int(s) for s in args.between.split(",")]
    if min(sizes) <= 0 or min(betweens) < 0 or args.iters < 1:
        ap.error("sizes must be > 0 MB, --between >= 0 MB and --iters >= 1")
    dev = torch.device("cuda", torch.cuda.current_device())
    sweep = torch.ones(512 * MB // 4, dtype=torch.int32, device=dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size / MB
    base = overhead_ms(sweep, args.iters)
    print(f"{torch.cuda.get_device_name(dev)}, L2 {l2:.0f} MiB; overhead {base * 1e3:.1f} us, "
          f"subtracted below")
    for size in sizes:
        x = torch.ones(size * MB // 4, dtype=torch.int32, device=dev)
        cold = statistics.median(time_read(x, [], sweep) for _ in range(args.iters)) - base
        for between in betweens:
            other = ([torch.ones(between * MB // 4, dtype=torch.int32, device=dev)]
                     if between else [])
            warm = statistics.median(
                time_read(x, [x, *other], sweep) for _ in range(args.iters)) - base
            if cold <= 0 or warm <= 0:  # within the overhead's noise: nothing to report
                print(f"{size:4d} MiB: below the launch overhead's resolution", flush=True)
                continue
            print(f"{size:4d} MiB: cold {cold * 1e3:8.1f} us ({size * MB / cold / 1e6:6.0f} GB/s), "
                  f"re-read after {between:3d} MiB of other reads {warm * 1e3:8.1f} us "
                  f"({size * MB / warm / 1e6:6.0f} GB/s): saves {100 * (1 - warm / cold):5.1f} %",
                  flush=True)


if __name__ == "__main__":
    main()
