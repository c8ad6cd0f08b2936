"""Ulysses sequence parallelism on the CPU: 2 and 4 processes on the gloo backend (and the
all-to-all path forced on a group of one), the torch reference as the per-rank ``attention``,
outputs equal to the unsharded reference bit for bit.

Every case of a world size runs in one group of fresh processes (``_ulysses.launch``, about a
second for all of them), in order, so the error cases also show that a rejected call leaves the
group usable: the case after them runs normally.
"""

from __future__ import annotations

import _ulysses
import pytest
import torch

from flashinfer_h3 import parallel
from flashinfer_h3.reference import varlen_attention_nvfp4_reference as nvfp4_ref

# Segments cross the shard boundaries of W = 2 (150) and W = 4 (75, 150, 225); 37..37 is empty,
# 151..300 is longer than one 128-row query block.
CROSSING = (0, 37, 37, 150, 151, 300)
GOOD = {
    "nvfp4": {"T": 300, "H": 0, "bounds": CROSSING, "op": "nvfp4"},
    "nvfp4_host": {"T": 300, "H": 0, "bounds": CROSSING, "op": "nvfp4", "host": True},
    "fp8": {"T": 300, "H": 0, "bounds": CROSSING, "op": "fp8", "host": True},
    "oracle_scale": {"T": 300, "H": 0, "bounds": CROSSING, "op": "oracle", "scale": 0.3},
    "chunks2": {"T": 300, "H": 0, "bounds": CROSSING, "op": "nvfp4", "chunks": 2, "host": True},
    "one_segment": {"T": 256, "H": 0, "bounds": (0, 256), "op": "fp8"},
    "padded": {"T": 301, "H": 0, "bounds": (0, 37, 37, 150, 151, 301), "op": "nvfp4"},
    "padded_fp8_chunks": {"T": 203, "H": 0, "bounds": (0, 100, 203), "op": "fp8",
                          "chunks": 2, "host": True},
    "tiny": {"T": 3, "H": 0, "bounds": (0, 1, 1, 3), "op": "nvfp4"},  # W = 4: a pure-pad rank
    "empty_segments_only": {"T": 0, "H": 0, "bounds": (0, 0, 0), "op": "nvfp4"},
    "no_tokens": {"T": 0, "H": 0, "bounds": (0,), "op": "nvfp4", "host": True},
}
# (case, corruption, rank (None: every rank), error type, words in the failing rank's message)
BAD = [
    ("heads_indivisible", None, None, "ValueError", "does not divide"),
    ("tokens", "tokens", 1, "ValueError", "expected ceil"),
    ("heads", "heads", 1, "ValueError", "heads on rank"),
    ("bounds", "bounds", 0, "ValueError", "cu_seqlens differs"),
    ("local_bounds", "local_bounds", None, "ValueError", "global bounds"),
    ("dtype", "dtype", 0, "ValueError", "torch.bfloat16"),
    ("not_tensor", "not_tensor", 1, "TypeError", "k must be a torch.Tensor"),
    ("scale", "scale", 1, "ValueError", "softmax_scale differs"),
    ("bad_scale", "bad_scale", 0, "ValueError", "softmax_scale must be finite"),
    ("precision", "precision", 1, "ValueError", "precision must be"),
    ("host_len", "host_len", 1, "ValueError", "cu_seqlens_host has"),
    ("decreasing", "decreasing", None, "ValueError", "non-decreasing"),
    ("chunks", "chunks", 1, "ValueError", "chunk count"),
]


def _cases(world: int) -> list[dict]:
    heads = 2 * world
    cases = [{**c, "name": n, "H": heads} for n, c in GOOD.items()]
    if world == 1:  # the all-to-all path forced on a group of one
        return [{**c, "force": True} for c in cases]
    for name, what, rank, _, _ in BAD:
        case = {"name": "bad_" + name, "T": 300, "H": heads, "bounds": CROSSING,
                "op": "nvfp4", "host": True, "chunks": 2}
        if what is None:
            case["H"] = world + 1
        else:
            case["bad"] = {"rank": rank, "what": what}
        cases.append(case)
    cases.append({**GOOD["nvfp4_host"], "name": "after_errors", "H": heads})
    cases.append({"name": "helpers", "T": 301, "H": 3, "helpers": True})
    if world == 4:  # two groups of 2 ranks, each with a sequence of its own
        cases.append({**GOOD["nvfp4_host"], "name": "split", "H": 4, "split": True, "seed": 7})
    return cases


@pytest.fixture(scope="module")
def runs(torch_one_thread) -> dict[int, tuple[list[dict], list[list[tuple]]]]:
    out = {}
    for world in (1, 2, 4):
        cases = _cases(world)
        out[world] = (cases, _ulysses.launch(world, cases))
    return out


def _result(runs, world: int, name: str) -> tuple[dict, list[tuple]]:
    cases, results = runs[world]
    i = next(i for i, c in enumerate(cases) if c["name"] == name)
    return cases[i], [results[r][i] for r in range(world)]


def _check_good(case: dict, per_rank: list[tuple], world: int) -> None:
    for r, res in enumerate(per_rank):
        assert res[0] == "ok", f"rank {r}: {res}"
    shards = [res[1] for res in per_rank]
    tl = -(-case["T"] // world)
    for s in shards:
        assert s.shape == (tl, case["H"], 128)
    full = torch.cat(shards)
    want = _ulysses.expected(case)
    assert full.dtype == want.dtype
    assert torch.equal(full[: case["T"]], want), "sharded output differs from the unsharded one"
    assert not full[case["T"]:].any(), "padding rows must be zero"


@pytest.mark.parametrize(("world", "name"), [
    (w, n) for w in (1, 2, 4) for n in [*GOOD, "after_errors"] if (w, n) != (1, "after_errors")
])
def test_equals_unsharded_reference(runs, world: int, name: str) -> None:
    case, per_rank = _result(runs, world, name)
    _check_good(case, per_rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_shard_and_gather_sequence(runs, world: int) -> None:
    case, per_rank = _result(runs, world, "helpers")
    q = _ulysses.case_inputs(case)[0]
    for r, res in enumerate(per_rank):
        assert res[0] == "ok", f"rank {r}: {res}"
        assert torch.equal(res[1], q)


def test_two_groups_of_two(runs) -> None:
    case, per_rank = _result(runs, 4, "split")
    _check_good(case, per_rank[:2], 2)
    _check_good({**case, "seed": 8}, per_rank[2:], 2)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("name", "what", "rank", "kind", "words"), BAD,
                         ids=[b[0] for b in BAD])
def test_bad_inputs_raise_on_every_rank(runs, world, name, what, rank, kind, words) -> None:
    _, per_rank = _result(runs, world, "bad_" + name)
    for r, res in enumerate(per_rank):
        assert res[0] == "err", f"rank {r} did not raise: {res[0]}"
        assert res[1] == kind, f"rank {r}: {res[1]}: {res[2]}"
    failing = per_rank[rank if rank is not None else 0]
    assert words in failing[2], failing[2]
    if rank is not None and what not in ("heads", "bounds", "scale", "chunks"):
        others = [res for r, res in enumerate(per_rank) if r != rank]
        assert all(f"rank {rank}" in res[2] and "nothing was communicated" in res[2]
                   for res in others), others


# ---------------------------------------------------------------------------------------------
# In-process: world size 1 without torch.distributed, helpers, argument logic
# ---------------------------------------------------------------------------------------------


def test_world_of_one_without_process_group(torch_one_thread) -> None:
    case = {**GOOD["nvfp4"], "H": 2}
    q, k, v = _ulysses.case_inputs(case)
    cu = torch.tensor(CROSSING, dtype=torch.int32)
    out = parallel.ulysses_attention(q, k, v, cu, attention=nvfp4_ref)
    assert torch.equal(out, nvfp4_ref(q, k, v, list(CROSSING)))
    with pytest.raises(ValueError, match="expected ceil"):
        parallel.ulysses_attention(q[:-1], k[:-1], v[:-1], cu, attention=nvfp4_ref)
    with pytest.raises(TypeError, match="attention must be callable"):
        parallel.ulysses_attention(q, k, v, cu, attention="reference")
    with pytest.raises(ValueError, match="CUDA"):  # the operators run on CUDA tensors
        parallel.ulysses_attention(q, k, v, cu)
    with pytest.raises(RuntimeError, match="not initialised"):
        parallel.ulysses_attention(q, k, v, cu, attention=nvfp4_ref, group=object())


def test_shard_and_gather_without_process_group() -> None:
    x = torch.arange(10.0).view(5, 2)
    assert torch.equal(parallel.shard_sequence(x), x)
    assert torch.equal(parallel.gather_sequence(x, 5), x)
    assert [parallel.local_tokens(t, 4) for t in (0, 1, 4, 5, 61_440)] == [0, 1, 1, 2, 15_360]
    with pytest.raises(ValueError):
        parallel.local_tokens(5, 0)


def test_chunk_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(parallel.ENV_CHUNKS, raising=False)
    assert parallel._chunks(None, 14, 61_440, 4) == 2  # h3-10s at W = 4
    assert parallel._chunks(None, 7, 61_440, 8) == 1  # odd heads per rank
    assert parallel._chunks(None, 14, 512, 4) == 1  # small call: nothing to overlap
    assert parallel._chunks(None, 56, 61_440, 1) == 1
    monkeypatch.setenv(parallel.ENV_CHUNKS, "7")
    assert parallel._chunks(None, 14, 512, 4) == 7
    monkeypatch.setenv(parallel.ENV_CHUNKS, "3")
    with pytest.raises(ValueError, match="divide the heads per rank"):
        parallel._chunks(None, 14, 512, 4)
    monkeypatch.setenv(parallel.ENV_CHUNKS, "two")
    with pytest.raises(ValueError, match="'auto' or a positive int"):
        parallel._chunks(None, 14, 512, 4)


def test_which_groups_carry_the_check_on_the_host() -> None:
    host = parallel._has_cpu_backend
    assert host("cpu:gloo,cuda:nccl") and host("cuda:nccl,cpu:gloo") and host("cpu:gloo,cuda:gloo")
    assert host("gloo") and host("GLOO")
    assert not host("cuda:nccl") and not host("nccl")
