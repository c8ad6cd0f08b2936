"""Ulysses sequence parallelism on GPUs with NCCL, against the single-GPU operator on the same
inputs, bit for bit (attention is per head: every rank does exactly the unsharded per-head work).

- world size 1 (one GPU, this process): the all-to-all path forced on a 1-rank NCCL group, with
  1 and 2 head chunks, eager, sync-free (check on the host, or off) and captured into a CUDA
  graph; and the direct path;
- 2 and 4 GPUs (skipped unless present): fresh processes (``_ulysses.launch``), segments crossing
  the shard boundaries, an empty segment, padding, head chunks, both precisions, an error on one
  rank, and a CUDA graph capture (padded, 2 chunks) replayed twice.

Small shapes: the whole file takes seconds once the kernels are built.
"""

from __future__ import annotations

import _ulysses
import pytest
import torch
import torch.distributed as dist

from flashinfer_h3 import diffusion_ops as ops
from flashinfer_h3 import parallel

pytestmark = pytest.mark.gpu

OPS = {"nvfp4": ops.minimax_h3_sm120_varlen_attention_nvfp4,
       "fp8": ops.minimax_h3_sm120_varlen_attention_fp8}
BOUNDS = (0, 1000, 1000, 2047, 2049, 4096)  # crosses 2048 (W = 2) and 1024, 3072 (W = 4)


@pytest.fixture(scope="module")
def groups() -> dict[str, dist.ProcessGroup]:
    """A world of one in this process: ``mixed`` (the world, ``cpu:gloo,cuda:nccl``: the argument
    check travels on the host) and ``nccl`` (NCCL only: the check is a device all-gather)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{_ulysses.free_port()}")
    yield {"mixed": dist.group.WORLD, "nccl": dist.new_group([0], backend="nccl")}
    dist.destroy_process_group()


@pytest.fixture
def world_one(groups) -> dist.ProcessGroup:
    return groups["nccl"]


def _inputs(tokens: int, heads: int, bounds: tuple[int, ...]):
    case = {"T": tokens, "H": heads, "bounds": bounds, "seed": 3}
    q, k, v = (x.cuda() for x in _ulysses.case_inputs(case))
    return q, k, v, torch.tensor(bounds, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("op", ["nvfp4", "fp8"])
def test_world_size_one_nccl(world_one, op: str) -> None:
    tokens, heads, bounds = (4096, 4, BOUNDS) if op == "nvfp4" else (600, 2, (0, 100, 100, 600))
    q, k, v, cu = _inputs(tokens, heads, bounds)
    want = OPS[op](q, k, v, cu, cu_seqlens_host=list(bounds))
    for chunks in (1, 2):
        got = parallel._ulysses(q, k, v, cu, group=world_one, precision=op, attention=None,
                                cu_seqlens_host=None, softmax_scale=None, chunks=chunks,
                                force_collectives=True)
        assert torch.equal(got, want), f"forced all-to-all path, {chunks} chunk(s)"
    got = parallel.ulysses_attention(q, k, v, cu, precision=op, cu_seqlens_host=list(bounds))
    assert torch.equal(got, want), "world size 1: the operator, called directly"
    with pytest.raises(ValueError, match="does not divide|expected ceil"):
        parallel._ulysses(q[:-1], k[:-1], v[:-1], cu, group=world_one, precision=op,
                          attention=None, cu_seqlens_host=None, softmax_scale=None,
                          force_collectives=True)


def test_world_size_one_sync_free(groups) -> None:
    """With cu_seqlens_host and the check on the host (or off), a call makes no host sync."""
    if ops._backend("nvfp4", torch.device("cuda", torch.cuda.current_device())).name == \
            "reference":
        pytest.skip("the NVFP4 operator runs on the reference backend here (it synchronises)")
    q, k, v, cu = _inputs(4096, 4, BOUNDS)
    host = list(BOUNDS)
    for group in (groups["mixed"], groups["nccl"]):
        want = parallel._ulysses(q, k, v, cu, group=group, precision="nvfp4", attention=None,
                                 cu_seqlens_host=host, softmax_scale=None, chunks=2,
                                 force_collectives=True)  # warm: plans, communicators
    torch.cuda.synchronize()
    for group, check in ((groups["mixed"], "1"), (groups["nccl"], "0")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(parallel.ENV_CHECK, check)
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = parallel._ulysses(q, k, v, cu, group=group, precision="nvfp4",
                                        attention=None, cu_seqlens_host=host,
                                        softmax_scale=None, chunks=2, force_collectives=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_world_size_one_cuda_graph(world_one) -> None:
    if ops._backend("nvfp4", torch.device("cuda", torch.cuda.current_device())).name == \
            "reference":
        pytest.skip("the NVFP4 operator runs on the reference backend here (not capturable)")
    q, k, v, cu = _inputs(4096, 4, BOUNDS)
    host = list(BOUNDS)

    def call() -> torch.Tensor:
        return parallel._ulysses(q, k, v, cu, group=world_one, precision="nvfp4",
                                 attention=None, cu_seqlens_host=host, softmax_scale=None,
                                 chunks=2, force_collectives=True)

    want = call()  # eager first (module load, NCCL communicator)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    got.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("world", [2, 4])
def test_multi_gpu_nccl_equals_single_gpu_operator(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, torch sees {torch.cuda.device_count()}")
    cases = [
        {"name": "nvfp4", "T": 4096, "H": 2 * world, "bounds": BOUNDS, "op": "nvfp4"},
        {"name": "nvfp4_chunks", "T": 4096, "H": 4 * world, "bounds": BOUNDS, "op": "nvfp4",
         "chunks": 2, "host": True},
        {"name": "nvfp4_padded", "T": 4097, "H": world, "bounds": (0, 3000, 3000, 4097),
         "op": "nvfp4", "host": True},
        {"name": "fp8", "T": 601, "H": world, "bounds": (0, 100, 100, 601), "op": "fp8"},
        {"name": "bad_heads", "T": 4096, "H": 2 * world, "bounds": BOUNDS, "op": "nvfp4",
         "bad": {"rank": 1, "what": "heads"}},
        {"name": "after_error", "T": 4096, "H": 2 * world, "bounds": BOUNDS, "op": "nvfp4",
         "host": True},
        {"name": "nvfp4_graph", "T": 4097, "H": 4 * world, "bounds": (0, 3000, 3000, 4097),
         "op": "nvfp4", "host": True, "chunks": 2, "graph": True},
    ]
    results = _ulysses.launch(world, cases, backend="nccl", timeout=600)
    for i, case in enumerate(cases):
        for rank in range(world):
            res = results[rank][i]
            if case["name"].startswith("bad"):
                assert res[0] == "err" and res[1] == "ValueError", (case["name"], rank, res)
                continue
            assert res[0] == "ok", (case["name"], rank, res)
            got, want = res[1], res[2]
            assert torch.equal(got, want), f"{case['name']}: rank {rank} differs from the " \
                                           "single-GPU operator"
