"""Ulysses sequence parallelism (``flashinfer_h3.parallel.ulysses_attention``): time per call and
the share spent in all-to-all, W GPUs of one host.

Usage (default shape h3-10s: one 61,440-token segment, 56 heads)::

    torchrun --nproc-per-node W benchmarks/bench_ulysses.py [--tokens 61440] [--heads 56]
        [--precision nvfp4] [--iters 3] [--warmup 1] [--chunks 1,2] [--json FILE]
    python benchmarks/bench_ulysses.py ...      # W = 1 without torchrun

Measured on every rank with CUDA events (mean over ``--iters`` calls after ``--warmup``; the
slowest rank is reported):

- ``call``: the whole ``ulysses_attention`` call, per head-chunk count (``--chunks``); at W = 1
  also ``direct`` (the default path there: the operator alone, no collective) and the all-to-all
  path forced on the 1-rank group;
- ``attention``: the operator alone on this rank's share, ``[W*Tl, H/W, 128]``;
- ``all-to-all``: the call's four ``all_to_all_single`` (q, k, v out; the output back) alone,
  same bytes, no transposes; ``share`` = all-to-all / call (what the exchange would cost if
  nothing overlapped it); ``exposed`` = call - attention (what the call pays beyond the
  operator: collectives not hidden, transposes, the argument check);
- ``transposes``: the call's four layout copies alone.

The process group is ``cpu:gloo,cuda:nccl`` by default (``--backend``), so the cross-rank
argument check travels on the host; ``--backend nccl`` shows the cost of the device check (one
sync per call) and ``--no-check`` the call without it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from flashinfer_h3 import diffusion_ops as ops
from flashinfer_h3 import parallel
from flashinfer_h3 import reference as ref

D = 128


def _init(backend: str, cpu: bool) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # plain python: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cpu:
        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    torch.cuda.set_device(local)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)


def _timed(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    """Mean ms per call of the slowest rank."""
    for _ in range(warmup):
        fn()
    if device.type == "cpu":  # --cpu smoke run: host clock
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = torch.tensor([(time.perf_counter() - t0) * 1e3 / iters])
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        return float(ms.item())
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / iters], device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms.item())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=61_440, help="global tokens (one segment)")
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--precision", choices=parallel.PRECISIONS, default="nvfp4",
                        help="fp8 runs on the torch reference until its kernel lands: slow, use "
                             "a small --tokens")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--chunks", default="1,2", help="head-chunk counts to time")
    parser.add_argument("--backend", default="cpu:gloo,cuda:nccl")
    parser.add_argument("--no-check", action="store_true",
                        help=f"{parallel.ENV_CHECK}=0: skip the cross-rank argument check")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true",
                        help="smoke run on the CPU: gloo, the torch reference as the operator "
                             "(use a small --tokens)")
    args = parser.parse_args()
    if args.no_check:
        os.environ[parallel.ENV_CHECK] = "0"

    rank, world, device = _init(args.backend, args.cpu)
    if args.heads % world:
        print(f"--heads {args.heads} is not divisible by the world size {world}", file=sys.stderr)
        return 2
    tl = parallel.local_tokens(args.tokens, world)
    hl, rows = args.heads // world, world * tl
    bounds = [0, args.tokens]
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    reference = {"nvfp4": ref.varlen_attention_nvfp4_reference,
                 "fp8": ref.varlen_attention_fp8_reference}[args.precision]
    attention = reference if args.cpu else None
    q, k, v = (torch.randn(tl, args.heads, D, device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    chunk_counts = [c for c in (int(x) for x in args.chunks.split(",")) if hl % c == 0]

    def call(chunks: int | None, force: bool) -> Callable[[], object]:
        return lambda: parallel._ulysses(
            q, k, v, cu, group=None, precision=args.precision, attention=attention,
            cu_seqlens_host=bounds, softmax_scale=None, chunks=chunks, force_collectives=force)

    results: dict[str, float] = {}
    if world == 1:
        results["call direct"] = _timed(call(None, False), args.iters, args.warmup, device)
    for c in chunk_counts:
        results[f"call chunks={c}"] = _timed(call(c, True), args.iters, args.warmup, device)

    # The operator alone on this rank's share.
    op = (ops.minimax_h3_sm120_varlen_attention_nvfp4 if args.precision == "nvfp4"
          else ops.minimax_h3_sm120_varlen_attention_fp8) if not args.cpu else reference
    op_bounds = bounds if args.tokens == rows else [*bounds, rows]
    op_cu = torch.tensor(op_bounds, dtype=torch.int32, device=device)
    heads_in = [torch.randn(rows, hl, D, device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(3)]
    results["attention"] = _timed(lambda: op(*heads_in, op_cu, cu_seqlens_host=op_bounds),
                                  args.iters, args.warmup, device)
    heads_in.clear()

    # The four all-to-alls alone, and the four transposes alone (chunks = 1).
    sends = [torch.empty((world, tl, hl, D), device=device, dtype=torch.bfloat16)
             for _ in range(4)]
    recvs = [torch.empty_like(s) for s in sends]

    def a2a() -> None:
        for s, r in zip(sends, recvs, strict=True):
            dist.all_to_all_single(r.view(torch.uint8), s.view(torch.uint8))

    results["all-to-all"] = _timed(a2a, args.iters, args.warmup, device)
    out = torch.empty_like(q)

    def transposes() -> None:
        for x, s in zip((q, k, v), sends[:3], strict=True):
            s.copy_(x.view(tl, world, hl, D).transpose(0, 1))
        out.view(tl, world, hl, D).copy_(recvs[3].transpose(0, 1))

    results["transposes"] = _timed(transposes, args.iters, args.warmup, device)

    if rank == 0:
        gpu = torch.cuda.get_device_name(device) if not args.cpu else "CPU (smoke run)"
        print(f"# ulysses_attention, {args.precision}, {args.tokens} tokens x {args.heads} heads "
              f"(one segment), W = {world} x {gpu}, {args.iters} iters, backend "
              f"{args.backend}, check {'off' if args.no_check else 'on'}")
        print(f"# per rank: {tl} tokens x {args.heads} heads in, {rows} tokens x {hl} heads "
              "attended")
        best = min(v for n, v in results.items() if n.startswith("call chunks"))
        a2a_ms = results["all-to-all"]
        print("| W | variant | ms per call | attention ms | all-to-all ms | a2a share | "
              "exposed ms | transposes ms |")
        print("|---|---|---|---|---|---|---|---|")
        for name, ms in results.items():
            if not name.startswith("call"):
                continue
            print(f"| {world} | {name[5:]} | {ms:.3f} | {results['attention']:.3f} | "
                  f"{a2a_ms:.3f} | {100 * a2a_ms / ms:.1f} % | "
                  f"{ms - results['attention']:.3f} | {results['transposes']:.3f} |")
        print(f"# best call {best:.3f} ms; all-to-all alone {a2a_ms:.3f} ms = "
              f"{100 * a2a_ms / best:.1f} % of it")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "gpu": gpu, "tokens": args.tokens,
                           "heads": args.heads, "precision": args.precision,
                           "backend": args.backend, "check": not args.no_check,
                           "iters": args.iters, "ms": results}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
