"""What re-reading a just-read chunk saves against a second DRAM read, by chunk size: the number
that decides the "single pass over K and V" pre-pass lever (issues 11 and 12).

The pre-pass reads k and v twice (launch 1 for the segment statistics, launch 3 for the codes,
templates/include/quantize/launch.cuh). A single persistent launch could quantise each (segment,
head) right after its statistics, so that the second read comes from L2, but only if L2 keeps
about one group's K and V (BF16: 15.7 MB for a 30,720-token segment, 31.5 MB for 61,440 tokens)
while the reads go on. This script models that on a 1 GiB buffer read in chunks of C MiB, each
read one launch (a float sum, which streams at DRAM speed), all launches of a pattern captured
in one CUDA graph and timed as its replay (launched one by one from Python, a 4 MiB read would
be paced by the host's ~10 us a call, not by memory):

- ``once``: every chunk read once (1 GiB);
- ``twice, apart``: the whole buffer read twice (2 GiB from DRAM: today's two passes);
- ``twice, back to back``: each chunk read twice in a row (the single pass).

- ``launches``: as many reads as ``once``, each of a chunk's first 4 KiB: what the launches
  themselves cost (~7.6 us each on the H200, RESULTS.md twenty-third session), which ``once``
  includes and the read of the bytes does not.

What a re-read right after the first saves of a DRAM read is (apart - back to back) /
(once - launches): 0 when it costs a DRAM read, below 1 even when L2 holds the whole chunk (an L2
read is not free). Nothing else streams between the two reads here, so this is an upper bound for
a persistent pre-pass whose other CTAs read other heads meanwhile. (The first version timed
single reads of a few MiB with an int64 sum, which upcasts through a temporary and ran at
~600 GB/s: launch- and write-bound, it could not see L2.)

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
    """Median ms of a replay of ``fn``'s launches captured as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (allocator, reduction setup)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
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

        def launches(parts: list[torch.Tensor] = parts) -> None:
            for p in parts:
                _read(p[:1024])

        t1, t2, tb, t0 = (time_ms(f, args.iters) for f in (once, apart, back_to_back, launches))
        dram = t1 - t0  # one pass's bytes from DRAM, the launches taken out
        saved = (t2 - tb) / dram if dram > 0 else float("nan")
        print(f"{chunk:4d} MiB chunks: once {t1:7.3f} ms ({TOTAL_MB * MB / dram / 1e9:5.2f} TB/s "
              f"without its {len(parts)} launches' {t0:.3f} ms), twice apart {t2:7.3f} ms, twice "
              f"back to back {tb:7.3f} ms: a re-read saves {100 * saved:5.1f} % of a DRAM read",
              flush=True)


if __name__ == "__main__":
    main()
