"""How much of a just-read chunk a second read finds in L2, by chunk size: the number that decides
the "single pass over K and V" pre-pass lever (issues 11 and 12).

The pre-pass reads k and v twice (launch 1 for the segment statistics, launch 3 for the codes,
templates/include/quantize/launch.cuh). A single persistent launch could quantise each (segment,
head) right after its statistics, so that the second read comes from L2, but only if L2 keeps
about one group's K and V (BF16: 15.7 MB for a 30,720-token segment, 31.5 MB for 61,440 tokens)
while the reads go on. This script models that on a 1 GiB buffer read in chunks of C MiB, each
read one launch (a float sum, which streams at DRAM speed), all launches of a pattern timed as
one sequence:

- ``once``: every chunk read once (1 GiB);
- ``twice, apart``: the whole buffer read twice (2 GiB from DRAM: today's two passes);
- ``twice, back to back``: each chunk read twice in a row (the single pass).

The share of the second reads that L2 serves is (apart - back to back) / (apart - once): 1 when a
re-read is free, 0 when it costs a DRAM read. (The first version timed single reads of a few MiB
with an int64 sum, which upcasts through a temporary and ran at ~600 GB/s: launch- and
write-bound, it could not see L2.)

    python benchmarks/bench_l2_reuse.py [--chunks 4,8,16,32,64] [--iters 5]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

MB = 1 << 20
TOTAL_MB = 1024


def _read(x: torch.Tensor) -> torch.Tensor:
    # One streaming read of every byte (a float reduction writes almost nothing back).
    return x.sum()


def time_ms(fn: Callable[[], None], iters: int) -> float:
    fn()  # warm-up (and the reduction's workspace)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", default="4,8,16,32,64", help="chunk sizes in MiB")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    chunks = [int(s) for s in args.chunks.split(",")]
    if min(chunks) <= 0 or max(chunks) > TOTAL_MB or args.iters < 1:
        ap.error(f"chunk sizes must be in 1..{TOTAL_MB} MiB and --iters >= 1")
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.rand(TOTAL_MB * MB // 4, device=dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size / MB
    print(f"{torch.cuda.get_device_name(dev)}, L2 {l2:.0f} MiB; a {TOTAL_MB} MiB buffer in chunks")
    for chunk in chunks:
        parts = list(buf.split(chunk * MB // 4))

        def once(parts: list[torch.Tensor] = parts) -> None:
            for p in parts:
                _read(p)

        def apart(parts: list[torch.Tensor] = parts) -> None:
            for _ in range(2):
                for p in parts:
                    _read(p)

        def back_to_back(parts: list[torch.Tensor] = parts) -> None:
            for p in parts:
                _read(p)
                _read(p)

        t1, t2, tb = (time_ms(f, args.iters) for f in (once, apart, back_to_back))
        served = (t2 - tb) / (t2 - t1) if t2 > t1 else float("nan")
        print(f"{chunk:4d} MiB chunks: once {t1:7.3f} ms ({TOTAL_MB * MB / t1 / 1e9:5.2f} TB/s), "
              f"twice apart {t2:7.3f} ms, twice back to back {tb:7.3f} ms: "
              f"L2 serves {100 * served:5.1f} % of the second reads", flush=True)


if __name__ == "__main__":
    main()
