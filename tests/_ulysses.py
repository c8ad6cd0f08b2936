"""Helpers of the Ulysses tests (``tests/unit/test_parallel_gloo.py``,
``tests/kernels/test_parallel_gpu.py``): a launcher of W local processes on one
``torch.distributed`` group, and the cases they run.

Processes come from a ``forkserver`` that has imported torch once (``launch``), so a group of
4 starts in about 0.1 s instead of one torch import per rank; they meet on a free TCP port of
127.0.0.1. Each rank runs every case of a list in order on the same group (an error case must
leave the group usable for the next one) and reports per case either ``("ok", output shard)``
or ``("err", exception type name, message)``.

A case is a dict: ``T`` real tokens, ``H`` heads, ``bounds`` (global cu_seqlens),
``op`` ("nvfp4" | "fp8" | "oracle": the reference function used as ``attention``; for NCCL
cases the public operator of that precision), optional ``scale``, ``host`` (pass
``cu_seqlens_host``), ``chunks``, ``seed``, ``force`` (the all-to-all path at world size 1),
``graph`` (NCCL: also capture the call into a CUDA graph and replay it), ``split`` (two groups
of ``W/2`` ranks), ``helpers`` (shard/gather round trip), and
``bad``: ``{"rank": r or None (all), "what": ...}`` to corrupt one rank's arguments (see
``_corrupt``).
"""

from __future__ import annotations

import datetime
import io
import queue
import socket
import traceback
import zlib
from typing import Any

import torch
import torch.multiprocessing as mp

D = 128
_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "flashinfer_h3.reference",
                                     "flashinfer_h3.parallel", "_ulysses"])
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cases: list[dict], backend: str = "gloo",
           timeout: float = 180.0) -> list[list[tuple]]:
    """Run ``cases`` on ``world`` fresh processes; ``result[rank][case]``."""
    ctx = _context()
    port = free_port()
    results: Any = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, backend, cases, results),
                         daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, payload = results.get(timeout=timeout)
            out[rank] = payload if isinstance(payload, str) else torch.load(io.BytesIO(payload))
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} did not finish in "
                             f"{timeout} s (a hang in a collective?)") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank in range(world):
        if isinstance(out[rank], str):
            raise AssertionError(f"rank {rank} crashed:\n{out[rank]}")
    return [out[r] for r in range(world)]


def case_inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full (unsharded) q, k, v of a case: bf16 ``[T, H, 128]`` on the CPU, the same in
    every process."""
    seed = case.get("seed", zlib.crc32(repr(sorted(case.items())).encode()))
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(case["T"], case["H"], D, generator=gen).to(torch.bfloat16)
                 for _ in range(3))


def reference_fn(op: str) -> Any:
    from flashinfer_h3 import reference as ref

    return {"nvfp4": ref.varlen_attention_nvfp4_reference,
            "fp8": ref.varlen_attention_fp8_reference, "oracle": ref.attention_oracle}[op]


def expected(case: dict) -> torch.Tensor:
    """The unsharded reference output of a CPU case."""
    q, k, v = case_inputs(case)
    return reference_fn(case["op"])(q, k, v, list(case["bounds"]),
                                    softmax_scale=case.get("scale"))


def _worker(rank: int, world: int, port: int, backend: str, cases: list[dict],
            results: Any) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # NCCL: room for a first JIT build of the kernels (the ranks build before they meet).
        seconds = 300 if backend == "nccl" else 60
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=seconds))
        payload = [_run_case(case, rank, world, backend) for case in cases]
        dist.barrier()
        dist.destroy_process_group()
        buf = io.BytesIO()  # by value: a tensor sent as a shared-memory handle dies with us
        torch.save(payload, buf)
        results.put((rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001 (report, do not hang the parent)
        results.put((rank, traceback.format_exc()))


def _run_case(case: dict, rank: int, world: int, backend: str) -> tuple:
    import torch.distributed as dist

    from flashinfer_h3 import diffusion_ops as ops
    from flashinfer_h3 import parallel

    group = None
    if case.get("split"):  # two groups of world/2 ranks, each a sequence of its own
        half = world // 2
        groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, world)))]
        group = groups[rank // half]
    sub_rank, sub_world = (dist.get_rank(group), dist.get_world_size(group))
    if case.get("split") and rank >= world // 2:
        case = {**case, "seed": case.get("seed", 0) + 1}  # the second group: other inputs
    q, k, v = case_inputs(case)
    if case.get("helpers"):  # shard_sequence / gather_sequence round trip
        full = parallel.gather_sequence(parallel.shard_sequence(q, group=group), case["T"],
                                        group=group)
        return ("ok", full)
    bounds = list(case["bounds"])
    shards = [_shard(x, sub_rank, sub_world) for x in (q, k, v)]
    if case["T"] % sub_world:  # padding rows: garbage that must be ignored
        tl = shards[0].shape[0]
        first_pad = max(0, case["T"] - sub_rank * tl)
        for s in shards:
            s[first_pad:] = float("nan")
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    ql, kl, vl = (s.to(device) for s in shards)
    kwargs: dict[str, Any] = {"group": group, "softmax_scale": case.get("scale")}
    if backend == "nccl":
        kwargs["precision"] = case["op"]
    else:
        kwargs["attention"] = reference_fn(case["op"])
    if case.get("host"):
        kwargs["cu_seqlens_host"] = bounds
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    args = [ql, kl, vl, cu]
    chunks = case.get("chunks")
    bad = case.get("bad")
    if bad and bad.get("rank") in (None, sub_rank):
        if bad["what"] == "chunks":  # another head split than the other ranks
            chunks = 1 if chunks != 1 else 2
        else:
            _corrupt(bad["what"], args, kwargs)
    precision = kwargs.pop("precision", "nvfp4")
    attention = kwargs.pop("attention", None)
    host = kwargs.pop("cu_seqlens_host", None)

    def call() -> torch.Tensor:
        return parallel._ulysses(*args, precision=precision, attention=attention,
                                 cu_seqlens_host=host, chunks=chunks,
                                 force_collectives=case.get("force", False), **kwargs)

    try:
        out = call()
    except Exception as exc:  # noqa: BLE001
        return ("err", type(exc).__name__, str(exc))
    if case.get("graph"):  # captured into a CUDA graph (after the eager call above)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        for _ in range(2):
            captured.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(captured, out):
            return ("err", "AssertionError", "a graph replay differs from the eager call")
        out = captured
    result: tuple = ("ok", out.cpu())
    if backend == "nccl":  # against the single-GPU operator on the full inputs, this GPU
        fn = (ops.minimax_h3_sm120_varlen_attention_nvfp4 if case["op"] == "nvfp4"
              else ops.minimax_h3_sm120_varlen_attention_fp8)
        full = fn(*(x.to(device) for x in (q, k, v)), cu, cu_seqlens_host=bounds,
                  softmax_scale=case.get("scale"))
        result = ("ok", out.cpu(), _shard(full.cpu(), sub_rank, sub_world))
    return result


def _shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    tl = -(-x.shape[0] // world)
    s = x.new_zeros((tl, *x.shape[1:]))
    part = x[rank * tl : (rank + 1) * tl]
    s[: part.shape[0]] = part
    return s


def _corrupt(what: str, args: list, kwargs: dict) -> None:
    q, k, v, cu = args
    if what == "tokens":  # one row fewer on this rank
        args[:3] = [x[:-1].contiguous() for x in (q, k, v)]
    elif what == "heads":  # twice the heads (still divisible by the world size)
        args[:3] = [torch.cat([x, x], dim=1) for x in (q, k, v)]
    elif what == "bounds":  # other global bounds, same count and total
        b = cu.tolist()
        b[1] = b[1] + 1 if b[1] < b[2] else b[1] - 1
        args[3] = torch.tensor(b, dtype=torch.int32, device=cu.device)
        if "cu_seqlens_host" in kwargs:
            kwargs["cu_seqlens_host"] = b
    elif what == "local_bounds":  # this rank's own bounds instead of the global ones
        args[3] = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=cu.device)
        kwargs.pop("cu_seqlens_host", None)
    elif what == "dtype":
        args[0] = q.to(torch.float16)
    elif what == "not_tensor":
        args[1] = k.tolist()
    elif what == "scale":
        kwargs["softmax_scale"] = 0.0625
    elif what == "bad_scale":
        kwargs["softmax_scale"] = -1.0
    elif what == "precision":
        kwargs["precision"] = "fp4"
    elif what == "host_len":
        kwargs["cu_seqlens_host"] = cu.tolist()[:-1]
    elif what == "decreasing":
        b = cu.tolist()
        b[1], b[2] = b[2] + 1, b[2]
        args[3] = torch.tensor(b, dtype=torch.int32, device=cu.device)
        kwargs.pop("cu_seqlens_host", None)
    else:
        raise AssertionError(f"unknown corruption {what!r}")
