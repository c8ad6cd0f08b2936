"""Plans, plan cache, workspace layout sizes, workspaces, custom ops and host overhead (CPU).

The operator pipeline runs here on CPU tensors with the CUDA check disabled and a fake kernel
module: the fake "kernels" compute the reference's quantized operands into the workspace views
and the attention from those views, so the plumbing (plan tables, layout, views, argument order
of docs/design.md) is checked against the reference bit for bit.
"""

from __future__ import annotations

import itertools
import math
import random
import threading
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashinfer_h3
from flashinfer_h3 import backends
from flashinfer_h3 import diffusion_ops as ops
from flashinfer_h3 import reference as ref
from flashinfer_h3 import workspace as wsmod
from flashinfer_h3.layout import (
    GROUP,
    HEAD_DIM,
    Q_BLOCK,
    REGION_ALIGN,
    V_KEY_PAD,
    fp8_layout,
    nvfp4_layout,
    q_blocks_cap,
    vkeys_cap,
)
from flashinfer_h3.plan import (
    FP8_CLUSTER_CTAS,
    NO_ROWS,
    PLAN_CACHE_SIZE,
    PLANS,
    SCHEDULE_ITEM_COST,
    SCHEDULE_TILE_KEYS,
    TABLE_NAMES,
    Plan,
    PlanCache,
    _split_tables,
    block_pairs,
    build_host_plan,
    captured_plan,
    device_flat_tables,
    item_schedule,
    striding_pair_schedule,
    striding_schedule,
)

CPU = torch.device("cpu")


def _random_bounds(rng: random.Random, segments: int, max_len: int, p_empty: float = 0.2):
    bounds = [0]
    for _ in range(segments):
        n = 0 if rng.random() < p_empty else rng.randint(1, max_len)
        bounds.append(bounds[-1] + n)
    return bounds


# ---------------------------------------------------------------------------------------------
# Host plan
# ---------------------------------------------------------------------------------------------

EDGE_BOUNDS = [[0], [0, 0], [0, 1], [0, 127], [0, 128], [0, 129], [0, 0, 5, 5, 0 + 5],
               [0, 256, 256, 257, 600], [0, 63, 64, 65, 1000]]


def _check_host_plan(bounds: list[int]) -> None:
    plan = build_host_plan(bounds)
    S = len(bounds) - 1
    lengths = [bounds[s + 1] - bounds[s] for s in range(S)]
    assert plan.bounds == tuple(bounds) and plan.num_segments == S and plan.tokens == bounds[-1]
    # V columns: each segment padded to a multiple of 64, in segment order.
    assert plan.vkey_start[0] == 0
    for s, L in enumerate(lengths):
        assert plan.vkey_start[s + 1] - plan.vkey_start[s] == math.ceil(L / V_KEY_PAD) * V_KEY_PAD
        assert plan.qblock_start[s + 1] - plan.qblock_start[s] == math.ceil(L / Q_BLOCK)
    assert plan.num_qblocks == plan.qblock_start[-1]
    # Every row covered once; canonical indices a permutation; blocks inside their segment.
    covered = [0] * bounds[-1]
    canon = sorted(blk[3] for blk in plan.qblocks)
    assert canon == list(range(plan.num_qblocks))
    for s, r0, r1, c in plan.qblocks:
        g = c - plan.qblock_start[s]
        assert 0 <= g < plan.qblock_start[s + 1] - plan.qblock_start[s]
        assert r0 == bounds[s] + Q_BLOCK * g and r1 == min(r0 + Q_BLOCK, bounds[s + 1]) and r1 > r0
        for r in range(r0, r1):
            covered[r] += 1
    assert covered == [1] * bounds[-1]
    # Schedule order: longest segment first, then segment index, then block index.
    keys = [(-lengths[s], s, c) for s, _, _, c in plan.qblocks]
    assert keys == sorted(keys)
    assert plan.sum_sq_lengths == sum(L * L for L in lengths)
    flat = plan.flat_tables()
    assert len(flat) == 3 * (S + 1) + 4 * plan.num_qblocks


@pytest.mark.parametrize("bounds", EDGE_BOUNDS, ids=str)
def test_host_plan_edges(bounds: list[int]) -> None:
    _check_host_plan(bounds)


def test_host_plan_random() -> None:
    rng = random.Random(1234)
    for _ in range(60):
        _check_host_plan(_random_bounds(rng, rng.randint(1, 12), rng.choice([5, 130, 700])))


# ---------------------------------------------------------------------------------------------
# The Hopper FP8 kernel's item schedule
# ---------------------------------------------------------------------------------------------

H3_MIX = (30720, 15360, 9216, 4096, 1536, 333)


def _schedule_runs(flat: list[int], ctas: int, padded: bool = False) -> list[list[int]]:
    begin, items = flat[: ctas + 1], flat[ctas + 1 :]
    assert begin[0] == 0 and (begin[-1] <= len(items) if padded else begin[-1] == len(items))
    assert all(a <= b for a, b in zip(begin[:-1], begin[1:], strict=True))
    return [items[begin[b] : begin[b + 1]] for b in range(ctas)]


def _loads(host, heads: int, runs: list[list[int]]) -> list[int]:
    nqb = host.num_qblocks
    length = [host.bounds[blk[0] + 1] - host.bounds[blk[0]] for blk in host.qblocks]
    cost = [-(-n // SCHEDULE_TILE_KEYS) + SCHEDULE_ITEM_COST for n in length]
    return [sum(cost[w % nqb] for w in run) for run in runs]


@pytest.mark.parametrize("ctas", [1, 7, 132])
@pytest.mark.parametrize("lengths", [(61440,), H3_MIX, (5, 0, 300, 129, 4097), (0,)],
                         ids=["h3-10s", "h3-mix", "small", "empty"])
def test_item_schedule_is_a_partition_in_order(lengths: tuple[int, ...], ctas: int) -> None:
    """Every item exactly once, each CTA's run in increasing item order (the head-major order
    that keeps concurrent CTAs on one or two heads), offsets from 0 to the item count."""
    host = build_host_plan([0, *itertools.accumulate(lengths)])
    heads = 3 if len(lengths) > 1 else 2
    runs = _schedule_runs(item_schedule(host, heads, ctas), ctas)
    flat = [w for run in runs for w in run]
    assert sorted(flat) == list(range(host.num_qblocks * heads))
    assert all(run == sorted(run) for run in runs)


def test_item_schedule_balances_packed_lengths() -> None:
    """On h3-mix (56 heads, 132 CTAs) the most loaded CTA has <= 0.2 % more work than the mean
    under the cost model, where striding gives > 1 %; on equal items (h3-10s) the schedule is
    striding itself."""
    ctas = 132
    host = build_host_plan([0, *itertools.accumulate(H3_MIX)])
    items = host.num_qblocks * 56
    balanced = _loads(host, 56, _schedule_runs(item_schedule(host, 56, ctas), ctas))
    stride = _schedule_runs(striding_schedule(items, ctas, CPU).tolist(), ctas)
    striding = _loads(host, 56, stride)
    assert sum(balanced) == sum(striding)
    mean = sum(balanced) / ctas
    assert max(balanced) / mean - 1 <= 0.002
    assert max(striding) / mean - 1 > 0.01
    single = build_host_plan([0, 61440])
    assert (item_schedule(single, 56, ctas)
            == striding_schedule(single.num_qblocks * 56, ctas, CPU).tolist())


@pytest.mark.parametrize(("items", "ctas"), [(0, 1), (1, 1), (5, 7), (393, 132), (26880, 132)])
def test_striding_schedule(items: int, ctas: int) -> None:
    """CTA b runs b, b + G, b + 2G, ... (the kernels' striding), computed by device ops."""
    runs = _schedule_runs(striding_schedule(items, ctas, CPU).tolist(), ctas)
    assert runs == [list(range(b, items, ctas)) for b in range(ctas)]


def _pair_runs(host, heads: int, flat: list[int], ctas: int) -> list[list[tuple[int, int]]]:
    """The clusters' runs of pairs of a cluster schedule (CTAs 2c and 2c + 1 entry by entry)."""
    runs = _schedule_runs(flat, ctas, padded=True)
    assert len(flat) == ctas + 1 + 2 * host.num_qblocks * heads  # padded to the binding's size
    assert all(len(runs[2 * c]) == len(runs[2 * c + 1]) for c in range(ctas // 2))
    return [list(zip(runs[2 * c], runs[2 * c + 1], strict=True)) for c in range(ctas // 2)]


@pytest.mark.parametrize("ctas", [2, 8, 132])
@pytest.mark.parametrize("lengths", [(61440,), H3_MIX, (5, 0, 300, 129, 4097, 256, 384), (0,)],
                         ids=["h3-10s", "h3-mix", "small", "empty"])
def test_cluster_schedule_pairs_every_block_once(lengths: tuple[int, ...], ctas: int) -> None:
    """With clusters of two CTAs every item is in exactly one pair, as its first or its second
    block; a pair is two consecutive blocks of one segment and head, or a segment's odd last block
    and itself flagged NO_ROWS; the clusters' runs keep the item order; the device-built striding
    order (a captured call's) has the same pairs."""
    host = build_host_plan([0, *itertools.accumulate(lengths)])
    heads = 3 if len(lengths) > 1 else 2
    nqb = host.num_qblocks
    pairs = block_pairs(host, heads)
    seen = []
    for first, second in pairs:
        seg, _, row_end, canonical = host.qblocks[first % nqb]
        seen.append(first)
        if second & NO_ROWS:
            assert second == first | NO_ROWS and canonical + 1 == host.qblock_start[seg + 1]
        else:
            nxt = host.qblocks[second % nqb]
            assert second == first + 1 and nxt[0] == seg
            assert nxt[3] == canonical + 1 and nxt[1] == row_end
            seen.append(second)
    assert sorted(seen) == list(range(nqb * heads))
    balanced = _pair_runs(host, heads, item_schedule(host, heads, ctas, 2), ctas)
    assert sorted(p for run in balanced for p in run) == sorted(pairs)
    assert all(run == sorted(run) for run in balanced)
    t = torch.tensor(host.flat_tables(), dtype=torch.int32)
    n = host.num_segments + 1
    qblocks, qblock_start = t[3 * n :].view(nqb, 4), t[2 * n : 3 * n]
    flat = striding_pair_schedule(qblocks, qblock_start, heads, ctas).tolist()
    strided = _pair_runs(host, heads, flat, ctas)
    clusters = ctas // 2
    assert strided == [pairs[c::clusters] for c in range(clusters)]


def test_item_schedule_errors_and_split() -> None:
    host = build_host_plan([0, 300, 301])
    with pytest.raises(ValueError, match="ctas"):
        item_schedule(host, 2, 0)
    with pytest.raises(ValueError, match="cluster_ctas"):
        item_schedule(host, 2, 3, 2)
    # Plans carry the production build's schedule (FP8_CLUSTER_CTAS CTAs a cluster).
    schedule = item_schedule(host, 2, 4, FP8_CLUSTER_CTAS)
    flat = torch.tensor(host.flat_tables() + schedule, dtype=torch.int32)
    tables = _split_tables(flat, host, 2)
    assert tables["cta_begin"].tolist() == schedule[:5]
    assert tables["cta_items"].numel() == FP8_CLUSTER_CTAS * host.num_qblocks * 2
    assert "cta_begin" not in _split_tables(torch.tensor(host.flat_tables()), host)
    with pytest.raises(ValueError, match="no item schedule"):
        _ = Plan.create(host, 2, CPU).schedule


def test_plan_tables_are_views_of_one_buffer() -> None:
    bounds = [0, 300, 300, 429]
    plan = Plan.create(build_host_plan(bounds), heads=4, device=CPU)
    flat = torch.tensor(plan.host.flat_tables(), dtype=torch.int32)
    t = plan.tables
    assert list(t) == list(TABLE_NAMES) and plan.args == tuple(t[n] for n in TABLE_NAMES)
    base = t["seg_bounds"].untyped_storage().data_ptr()
    for name in TABLE_NAMES:
        assert t[name].dtype == torch.int32 and t[name].is_contiguous()
        assert t[name].untyped_storage().data_ptr() == base
    assert torch.equal(torch.cat([t[n].flatten() for n in TABLE_NAMES]), flat)
    assert t["seg_bounds"].tolist() == bounds
    assert t["qblocks"].shape == (plan.host.num_qblocks, 4)
    assert [tuple(r) for r in t["qblocks"].tolist()] == list(plan.host.qblocks)


# ---------------------------------------------------------------------------------------------
# Plan cache
# ---------------------------------------------------------------------------------------------


def test_plan_cache_lru() -> None:
    assert PLAN_CACHE_SIZE >= 256 and PLANS.capacity >= 256
    cache = PlanCache(capacity=3)
    a, b, c, d = ((0, n) for n in (10, 20, 30, 40))
    pa = cache.get(a, 2, CPU)
    assert cache.get(a, 2, CPU) is pa and len(cache) == 1
    cache.get(b, 2, CPU)
    cache.get(c, 2, CPU)
    assert cache.get(a, 2, CPU) is pa  # a becomes the most recently used
    cache.get(d, 2, CPU)  # evicts b, the least recently used
    assert len(cache) == 3
    assert cache.lookup(b, 2, CPU) is None
    assert cache.lookup(a, 2, CPU) is pa
    assert cache.lookup(c, 2, CPU) is not None and cache.lookup(d, 2, CPU) is not None
    # heads and device are part of the key; lookup never creates
    assert cache.lookup(a, 3, CPU) is None and len(cache) == 3
    assert cache.get(a, 3, CPU) is not pa
    assert cache.lookup(a, 2, torch.device("meta")) is None
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="capacity"):
        PlanCache(capacity=0)


def test_plan_cache_holds_its_capacity() -> None:
    cache = PlanCache(capacity=300)
    for n in range(310):
        cache.get((0, n + 1), 1, CPU)
    assert len(cache) == 300
    assert cache.lookup((0, 1), 1, CPU) is None and cache.lookup((0, 310), 1, CPU) is not None


def test_captured_plan_is_built_from_cu_seqlens_and_not_cached() -> None:
    PLANS.clear()
    bounds = (0, 77, 77, 300)
    cu = torch.tensor(bounds, dtype=torch.int32)
    p1 = captured_plan(bounds, 2, cu)
    p2 = captured_plan(bounds, 2, cu)
    assert len(PLANS) == 0 and p1.captured and p2.captured and p1.device == cu.device
    # each captured call gets its own tables (temporaries of that call)
    assert p1.tables["seg_bounds"].data_ptr() != p2.tables["seg_bounds"].data_ptr()
    eager = Plan.create(build_host_plan(bounds), 2, CPU)
    for name in TABLE_NAMES:
        assert torch.equal(p1.tables[name], eager.tables[name])
    # The tables come from cu_seqlens' contents (what a graph replay reads), not from a host
    # copy: the host bounds only fix the shapes.
    shifted = torch.tensor((0, 76, 76, 300), dtype=torch.int32)
    p3 = captured_plan(bounds, 2, shifted)
    assert p3.tables["seg_bounds"].tolist() == shifted.tolist()


def _device_tables_equal_host(bounds: list[int]) -> None:
    host = build_host_plan(bounds)
    cu = torch.tensor(bounds, dtype=torch.int32)
    flat = device_flat_tables(cu, bounds[-1], host.num_qblocks)
    expected = torch.tensor(host.flat_tables(), dtype=torch.int32)
    assert flat.dtype == torch.int32 and flat.shape == expected.shape, bounds
    assert torch.equal(flat, expected), bounds  # ints: bit for bit


@pytest.mark.parametrize("bounds", EDGE_BOUNDS + [[0, 1, 2, 3], [0, 128, 256, 384],
                                                  [0, 129, 129, 258], [0, 0, 0, 1]], ids=str)
def test_device_tables_edges(bounds: list[int]) -> None:
    _device_tables_equal_host(bounds)


def test_device_tables_random() -> None:
    """The device builder (run here on the CPU: the same torch ops) equals the host plan bit
    for bit: empty and 1-token segments, 127/128/129, equal lengths (schedule ties), many
    segments."""
    rng = random.Random(99)
    for _ in range(400):
        segments = rng.choice([1, 2, 3, 7, 16, 64, 300, 1000])
        bounds = [0]
        for _ in range(segments):
            r = rng.random()
            if r < 0.2:
                n = 0
            elif r < 0.5:
                n = rng.choice([1, 2, 63, 64, 65, 127, 128, 129, 256, 257])
            else:
                n = rng.randint(1, 3000 if segments < 64 else 300)
            bounds.append(bounds[-1] + n)
        _device_tables_equal_host(bounds)


class _OpLog(TorchDispatchMode):
    """Names of the ops run, and the devices of every tensor they take or return."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func.name())
        flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple) else (out,))]
        self.devices |= {t.device.type for t in flat if isinstance(t, torch.Tensor)}
        return out


def test_device_tables_read_nothing_on_the_host() -> None:
    """Capturable: no op reads device memory on the host (``item``, ``nonzero``, ``tolist``: a
    sync, and illegal in a capture) and no tensor is made from host data (a host-to-device
    copy from pageable memory: illegal in a capture). Meta tensors have no data, so the
    builder running on them proves the first; that no op sees a tensor of another device
    proves the second."""
    cu = torch.empty(6, dtype=torch.int32, device="meta")
    with _OpLog() as log:
        flat = device_flat_tables(cu, 1000, 11)
    assert flat.device.type == "meta" and flat.shape == (3 * 6 + 4 * 11,)
    assert log.devices == {"meta"}, log.devices
    forbidden = {"aten::_local_scalar_dense", "aten::nonzero", "aten::lift_fresh",
                 "aten::unique", "aten::masked_select", "aten::_pin_memory"}
    assert not forbidden & set(log.names), sorted(forbidden & set(log.names))
    # torch.tensor(data, device=...) copies host data without a dispatched op: check the source
    import inspect

    source = inspect.getsource(device_flat_tables)
    for call in ("torch.tensor(", "as_tensor(", "from_numpy(", ".tolist(", ".item(", "pin_memory"):
        assert call not in source, call


def test_device_tables_stay_in_range_for_other_contents() -> None:
    """cu_seqlens contents that do not match the host bounds (e.g. changed before a graph
    replay) give wrong tables, but every row range stays inside [0, tokens], every index inside
    its table, and the V columns / query blocks inside the layout's caps."""
    rng = random.Random(5)
    for _ in range(300):
        segments = rng.randint(1, 9)
        tokens = rng.randint(1, 2000)
        host_bounds = sorted([0, tokens] + [rng.randint(0, tokens) for _ in range(segments - 1)])
        nqb = build_host_plan(host_bounds).num_qblocks
        other = [rng.randint(-300, tokens + 300) for _ in range(segments + 1)]
        flat = device_flat_tables(torch.tensor(other, dtype=torch.int32), tokens, nqb)
        n = segments + 1
        seg_bounds, vkey, qstart = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        blocks = flat[3 * n :].view(nqb, 4)
        assert int(seg_bounds.min()) >= 0 and int(seg_bounds.max()) <= tokens
        assert bool((seg_bounds[1:] >= seg_bounds[:-1]).all())
        assert int(vkey[-1]) <= vkeys_cap(tokens, segments)
        assert int(qstart[-1]) <= q_blocks_cap(tokens, segments)
        seg, r0, r1, canon = blocks.unbind(1)
        assert bool(((seg >= 0) & (seg < segments)).all())
        assert bool(((r0 >= 0) & (r0 <= r1) & (r1 <= tokens)).all())
        assert sorted(canon.tolist()) == list(range(nqb))
        # rows stay inside their own segment, so V columns stay inside the segment's columns
        assert bool((r0 >= seg_bounds[seg]).all() and (r1 <= seg_bounds[seg + 1]).all())


# ---------------------------------------------------------------------------------------------
# Workspace layout and sizes
# ---------------------------------------------------------------------------------------------


def _max_blocks(tokens: int, segments: int, size: int) -> int:
    """Brute force: max of sum ceil(L_i / size) over segmentations of tokens into segments."""
    best = [0] + [-1] * tokens  # best[t]: max over segmentations of t tokens so far
    for _ in range(segments):
        best = [max(best[t - L] + -(-L // size) for L in range(t + 1) if best[t - L] >= 0)
                for t in range(tokens + 1)]
    return best[tokens]


@pytest.mark.parametrize("tokens,segments", [(0, 0), (0, 3), (1, 1), (5, 3), (130, 2),
                                             (200, 3), (300, 4), (129, 1)])
def test_caps_are_tight_upper_bounds(tokens: int, segments: int) -> None:
    if segments == 0:
        assert q_blocks_cap(tokens, segments) == 0 and vkeys_cap(tokens, segments) == 0
        return
    assert q_blocks_cap(tokens, segments) == _max_blocks(tokens, segments, Q_BLOCK)
    assert vkeys_cap(tokens, segments) == V_KEY_PAD * _max_blocks(tokens, segments, V_KEY_PAD)


def _expected_total(specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    total = 0
    for dtype, shape in specs:
        total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        total = -(-total // REGION_ALIGN) * REGION_ALIGN
    return total


SHAPES = [(0, 1, 0), (1, 1, 1), (200, 2, 3), (4096, 14, 7), (61440, 56, 1), (92160, 14, 4)]


@pytest.mark.parametrize("tokens,heads,segments", SHAPES)
def test_workspace_bytes_exact(tokens: int, heads: int, segments: int) -> None:
    T, H, S, D = tokens, heads, segments, HEAD_DIM
    nqb, nvk = q_blocks_cap(T, S), vkeys_cap(T, S)
    u8, f32 = torch.uint8, torch.float32
    nv = _expected_total([(f32, (S, H, D)), (f32, (nqb, H, D)), (u8, (H, T, D // 2)),
                          (u8, (H, T, D // GROUP)), (u8, (H, T, D // 2)),
                          (u8, (H, T, D // GROUP)), (u8, (H, D, nvk // 2)),
                          (u8, (H, D, nvk // GROUP))])
    f8 = _expected_total([(f32, (S, H, D)), (u8, (H, T, D)), (f32, (H, T)), (u8, (H, T, D)),
                          (f32, (H, nqb)), (u8, (H, D, nvk)), (f32, (S, H, D))])
    # The operators' own layouts: what the mma.sync backends use (without a backend argument a
    # GPU host answers for its auto backend, e.g. the Hopper NVFP4 kernel's larger layout).
    assert flashinfer_h3.workspace_bytes_nvfp4(T, H, S, backend="mma_sync_fp4") == nv
    assert flashinfer_h3.workspace_bytes_fp8(T, H, S, backend="mma_sync_fp8") == f8
    if not torch.cuda.is_available():
        assert flashinfer_h3.workspace_bytes_nvfp4(T, H, S) == nv
        assert flashinfer_h3.workspace_bytes_fp8(T, H, S) == f8
    for layout in (nvfp4_layout(T, H, S), fp8_layout(T, H, S)):
        # regions ordered, aligned, disjoint, inside the total
        end = 0
        for r in layout.regions:
            assert r.offset % REGION_ALIGN == 0 and r.offset >= end
            end = r.offset + r.nbytes
        assert end <= layout.total_bytes < end + REGION_ALIGN
        if layout.total_bytes and T <= 4096:
            exact = torch.zeros(layout.total_bytes, dtype=torch.uint8)
            views = layout.views(exact)
            assert [tuple(v.shape) for v in views.values()] == [r.shape for r in layout.regions]
            with pytest.raises(ValueError, match="needs"):
                layout.views(exact[:-1])


def test_workspace_bytes_errors() -> None:
    with pytest.raises(TypeError, match="tokens"):
        flashinfer_h3.workspace_bytes_nvfp4(1.5, 2, 1)
    with pytest.raises(ValueError, match="num_heads"):
        flashinfer_h3.workspace_bytes_fp8(10, 0, 1)
    with pytest.raises(ValueError, match="segment"):
        flashinfer_h3.workspace_bytes_nvfp4(10, 2, 0)
    with pytest.raises(ValueError, match="num_segments"):
        flashinfer_h3.workspace_bytes_fp8(10, 2, -1)


def test_workspace_bytes_monotone_in_tokens() -> None:
    for fn in (flashinfer_h3.workspace_bytes_nvfp4, flashinfer_h3.workspace_bytes_fp8):
        sizes = [fn(t, 3, 2) for t in range(0, 1000, 37)]
        assert sizes == sorted(sizes)


# ---------------------------------------------------------------------------------------------
# Workspaces
# ---------------------------------------------------------------------------------------------


def test_workspace_grows_only_and_caches_views() -> None:
    ws = wsmod.Workspace(CPU)
    small = wsmod.layout_for("nvfp4", 300, 2, 2)
    big = wsmod.layout_for("nvfp4", 40000, 4, 2)
    v1 = ws.views(small)
    assert ws.grow_count == 1 and ws.nbytes >= small.total_bytes
    assert ws.nbytes % wsmod.GROW_GRANULE == 0
    assert ws.views(small) is v1  # cached: nothing rebuilt
    buf1 = ws.buffer
    v2 = ws.views(big)
    assert ws.grow_count == 2 and ws.nbytes >= big.total_bytes and ws.buffer is not buf1
    assert ws.views(small) is not v1  # views of the old buffer were dropped
    buf2 = ws.buffer
    ws.views(wsmod.layout_for("fp8", 1000, 4, 3))
    ws.views(small)
    assert ws.buffer is buf2 and ws.grow_count == 2  # never shrinks, no regrowth
    lo, hi = buf2.data_ptr(), buf2.data_ptr() + buf2.numel()
    for v in (*ws.views(small), *v2):
        assert lo <= v.data_ptr() and v.data_ptr() + v.nbytes <= hi


def test_workspace_per_device_and_stream_shared_by_ops() -> None:
    wsmod.release_workspaces()
    a = wsmod.workspace_for(CPU, 0)
    assert wsmod.workspace_for(CPU, 0) is a
    assert wsmod.workspace_for(CPU, 12345) is not a
    nv = wsmod.eager_views(wsmod.layout_for("nvfp4", 500, 2, 1), CPU, 0)
    f8 = wsmod.eager_views(wsmod.layout_for("fp8", 500, 2, 1), CPU, 0)
    assert a.buffer is not None
    base, end = a.buffer.data_ptr(), a.buffer.data_ptr() + a.nbytes
    assert all(base <= v.data_ptr() < end for v in (*nv, *f8))  # one buffer, both operators
    assert set(wsmod.workspaces()) == {(CPU, 0), (CPU, 12345)}
    wsmod.release_workspaces()
    assert wsmod.workspaces() == {}


def test_captured_views_are_fresh_and_exact() -> None:
    layout = wsmod.layout_for("nvfp4", 300, 2, 2)
    v1 = wsmod.captured_views(layout, CPU)
    v2 = wsmod.captured_views(layout, CPU)
    assert v1[0].untyped_storage().nbytes() == layout.total_bytes
    assert v1[0].data_ptr() != v2[0].data_ptr()
    assert [tuple(v.shape) for v in v1] == [r.shape for r in layout.regions]


def test_cache_buffers_are_allocated_on_the_helper_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long-lived CUDA buffers are allocated on another thread (torch routes a cudagraph-tree
    warm-up's allocations per thread); CPU ones directly. No GPU: the CUDA branch is observed
    through the function it hands to the helper thread."""
    main = threading.get_ident()
    helper = wsmod.on_allocator_thread(threading.get_ident)
    assert helper != main and wsmod.on_allocator_thread(threading.get_ident) == helper
    # from the helper thread itself it runs inline (no deadlock)
    assert wsmod.on_allocator_thread(wsmod.on_allocator_thread, threading.get_ident) == helper
    seen: list[tuple[Any, ...]] = []

    def fake_on_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((fn, args, kwargs))
        return torch.empty(args[0], dtype=kwargs["dtype"])

    monkeypatch.setattr(wsmod, "on_allocator_thread", fake_on_thread)
    cpu = wsmod.cache_empty(10, torch.int32, CPU)
    assert cpu.shape == (10,) and seen == []
    wsmod.cache_empty(7, torch.uint8, torch.device("cuda", 1))
    assert seen == [(torch.empty, (7,), {"dtype": torch.uint8,
                                         "device": torch.device("cuda", 1)})]


def test_layout_for_is_cached_and_checks_op() -> None:
    assert wsmod.layout_for("fp8", 10, 1, 1) is wsmod.layout_for("fp8", 10, 1, 1)
    with pytest.raises(ValueError, match="op"):
        wsmod.layout_for("int4", 10, 1, 1)


# ---------------------------------------------------------------------------------------------
# The operator pipeline on CPU with a fake kernel module
# ---------------------------------------------------------------------------------------------

NV_NAMES = ("kbar", "qbar", "q_codes", "q_scales", "k_codes", "k_scales", "v_codes", "v_scales")


class FakeNvfp4Module:
    """quantize_nvfp4 / attention_nvfp4 with the signatures of docs/design.md, computed by the
    reference from what the kernels receive (plan tables and workspace views only)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def quantize_nvfp4(self, q, k, v, seg_bounds, vkey_start, qblock_start, qblocks, *views):
        self.calls.append("quantize")
        assert len(views) == 8 and qblocks.shape[1] == 4
        bounds = seg_bounds.tolist()
        plan = build_host_plan(bounds)
        assert vkey_start.tolist() == list(plan.vkey_start)
        assert qblock_start.tolist() == list(plan.qblock_start)
        assert [tuple(r) for r in qblocks.tolist()] == list(plan.qblocks)
        stages = ref.nvfp4_quantize_stages(q, k, v, bounds)
        for name, view in zip(NV_NAMES, views, strict=True):
            src = stages[name]
            assert view.dtype == src.dtype, name
            view.fill_(0xFF if view.dtype == torch.uint8 else math.nan)  # poison, then write
            view[tuple(slice(0, n) for n in src.shape)].copy_(src)

    def attention_nvfp4(self, out, qbar, q_codes, q_scales, k_codes, k_scales, v_codes,
                        v_scales, seg_bounds, vkey_start, qblocks, softmax_scale):
        self.calls.append("attention")
        assert isinstance(softmax_scale, float)
        stages = dict(zip(NV_NAMES[1:], (qbar, q_codes, q_scales, k_codes, k_scales, v_codes,
                                         v_scales), strict=True))
        out.copy_(ref.nvfp4_attention_from_stages(stages, seg_bounds.tolist(), softmax_scale))


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> FakeNvfp4Module:
    module = FakeNvfp4Module()
    kernel = backends.get("nvfp4", "mma_sync_fp4_emulated")
    backend = backends.Prepared(kernel, kernel.make_launcher(module, kernel))
    ref_fp8 = backends.get("fp8", "reference")
    reference = backends.Prepared(ref_fp8, ref_fp8.make_launcher(None, ref_fp8))
    monkeypatch.setattr(ops, "check_cuda", lambda q: None)
    monkeypatch.setattr(ops, "_backend",
                        lambda op, device: backend if op == "nvfp4" else reference)
    PLANS.clear()
    wsmod.release_workspaces()
    yield module
    PLANS.clear()
    wsmod.release_workspaces()


def _inputs(T: int, H: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, H, HEAD_DIM, generator=g).bfloat16() for _ in range(3))


def test_pipeline_matches_reference(fake_kernels: FakeNvfp4Module,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = [0, 37, 37, 200, 333]
    T, H = bounds[-1], 2
    q, k, v = _inputs(T, H, seed=7)
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = torch.full((T, H, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    res = ops.varlen_attention_nvfp4(q, k, v, cu, out, cu_seqlens_host=bounds,
                                     softmax_scale=0.07)
    expected = ref.varlen_attention_nvfp4_reference(q, k, v, bounds, 0.07)
    assert res is out and torch.equal(out, expected) and not out.isnan().any()
    assert fake_kernels.calls == ["quantize", "attention"] and len(PLANS) == 1
    ws = wsmod.workspace_for(CPU, 0)
    grown = ws.grow_count
    # Second call: cached plan (no Plan.create), same workspace, no growth; out allocated.
    created = []
    real_create = Plan.create
    monkeypatch.setattr(Plan, "create", classmethod(
        lambda cls, *a: created.append(a) or real_create(*a)))
    q2, k2, v2 = _inputs(T, H, seed=8)
    res2 = ops.varlen_attention_nvfp4(q2, k2, v2, cu)  # no host copy: reads cu_seqlens
    assert torch.equal(res2, ref.varlen_attention_nvfp4_reference(q2, k2, v2, bounds))
    assert created == [] and ws.grow_count == grown and len(PLANS) == 1
    # FP8 runs on the reference backend: no workspace, no plan.
    res3 = ops.varlen_attention_fp8(q2, k2, v2, cu, cu_seqlens_host=bounds)
    assert torch.equal(res3, ref.varlen_attention_fp8_reference(q2, k2, v2, bounds))
    assert len(PLANS) == 1


def test_captured_call_builds_tables_and_caches_nothing(fake_kernels: FakeNvfp4Module,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call made while the stream captures: device-built tables (checked against the host
    plan by the fake kernels) and a temporary workspace; no plan, no eager workspace."""
    monkeypatch.setattr(ops, "_stream_state", lambda device: (0, True))
    bounds = [0, 1, 129, 129, 600]
    q, k, v = _inputs(600, 2, seed=12)
    cu = torch.tensor(bounds, dtype=torch.int32)
    out = torch.full_like(q, math.nan)
    ops.varlen_attention_nvfp4(q, k, v, cu, out, cu_seqlens_host=bounds, softmax_scale=0.09)
    assert torch.equal(out, ref.varlen_attention_nvfp4_reference(q, k, v, bounds, 0.09))
    assert fake_kernels.calls == ["quantize", "attention"]
    assert len(PLANS) == 0 and wsmod.workspaces() == {}
    with pytest.raises(ValueError, match="^cu_seqlens_host is required"):
        ops.varlen_attention_nvfp4(q, k, v, cu, out)


def test_zero_tokens_launches_nothing(fake_kernels: FakeNvfp4Module) -> None:
    q, k, v = (torch.empty(0, 3, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3))
    res = ops.varlen_attention_nvfp4(q, k, v, torch.zeros(3, dtype=torch.int32))
    assert res.shape == (0, 3, HEAD_DIM) and fake_kernels.calls == []


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_call_skips_the_dispatcher(fake_kernels: FakeNvfp4Module) -> None:
    bounds = [0, 100, 150]
    q, k, v = _inputs(150, 1, seed=3)
    cu = torch.tensor(bounds, dtype=torch.int32)
    ops.varlen_attention_nvfp4(q, k, v, cu, cu_seqlens_host=bounds)  # warm
    with _OpRecorder() as rec:
        ops.varlen_attention_nvfp4(q, k, v, cu, cu_seqlens_host=bounds)
    assert not [o for o in rec.ops if "flashinfer_h3" in o], rec.ops[:5]
    with _OpRecorder() as rec:  # control: the custom op itself is visible to the dispatcher
        torch.ops.flashinfer_h3.varlen_attention_nvfp4(q, k, v, cu, bounds, None)
    assert any("flashinfer_h3.varlen_attention_nvfp4" in o for o in rec.ops)


# ---------------------------------------------------------------------------------------------
# Custom ops and torch.compile
# ---------------------------------------------------------------------------------------------


def test_custom_op_schemas() -> None:
    for op in ("nvfp4", "fp8"):
        f = getattr(torch.ops.flashinfer_h3, f"varlen_attention_{op}").default._schema
        o = getattr(torch.ops.flashinfer_h3, f"varlen_attention_{op}_out").default._schema
        assert str(f).endswith("-> Tensor") and "Tensor q" in str(f)
        assert "float? softmax_scale" in str(f) and "[]? cu_seqlens_host" in str(f)
        assert "Tensor(a4!) out" in str(o) and str(o).endswith("-> ()")


def test_fake_impl_shapes_and_checks() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(300, 4, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3))
        cu = torch.empty(3, dtype=torch.int32)
        for op in ("nvfp4", "fp8"):
            res = getattr(torch.ops.flashinfer_h3, f"varlen_attention_{op}")(
                q, k, v, cu, [0, 100, 300], 0.1)
            assert res.shape == q.shape and res.dtype == torch.bfloat16
            getattr(torch.ops.flashinfer_h3, f"varlen_attention_{op}_out")(
                q, k, v, cu, torch.empty_like(q), None, None)
        with pytest.raises(ValueError, match="^k has shape"):
            torch.ops.flashinfer_h3.varlen_attention_nvfp4(q, k[:10], v, cu, None, None)
        with pytest.raises(ValueError, match="^softmax_scale"):
            torch.ops.flashinfer_h3.varlen_attention_fp8(q, k, v, cu, None, -1.0)


def test_torch_compile_fullgraph_cpu(fake_kernels: FakeNvfp4Module) -> None:
    torch._dynamo.reset()
    bounds = [0, 130, 140]
    q, k, v = _inputs(140, 2, seed=11)
    cu = torch.tensor(bounds, dtype=torch.int32)

    def f(q, k, v, cu, out):
        a = ops.varlen_attention_nvfp4(q, k, v, cu, cu_seqlens_host=bounds, softmax_scale=0.1)
        ops.varlen_attention_nvfp4(q, k, v, cu, out, cu_seqlens_host=bounds)
        return a.float() + 1.0

    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm.code)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    out_c, out_e = (torch.full_like(q, math.nan) for _ in range(2))
    res_c = compiled(q, k, v, cu, out_c)
    res_e = f(q, k, v, cu, out_e)
    assert torch.equal(res_c, res_e) and torch.equal(out_c, out_e)
    assert not out_c.isnan().any()
    assert len(graphs) == 1  # one graph, through the custom ops (functional and _out)
    assert "torch.ops.flashinfer_h3.varlen_attention_nvfp4.default(" in graphs[0]
    assert "torch.ops.flashinfer_h3.varlen_attention_nvfp4_out.default(" in graphs[0]
    assert fake_kernels.calls == ["quantize", "attention"] * 4
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Host overhead
# ---------------------------------------------------------------------------------------------


@pytest.mark.nvcc
@pytest.mark.slow
def test_kernel_runner_matches_the_compiled_binding() -> None:
    """The runner's calls have the arity and argument types of the real tvm-ffi exports: with
    CPU tensors they get past tvm-ffi's typed signature (a mismatch is a TypeError) and stop at
    the C++ device checks (ValueError). Builds or reuses the session's sm_90a nvfp4 module."""
    from flashinfer_h3.jit import KernelConfig, build_module, load_so

    module = load_so(build_module(KernelConfig("nvfp4", arch="sm_90a")))
    errors: dict[str, str] = {}

    class Probe:
        def __getattr__(self, name: str) -> Any:
            fn = getattr(module, name)

            def call(*args: Any) -> None:
                try:
                    fn(*args)
                except ValueError as exc:  # reached the C++ checks
                    errors[name] = str(exc)

            return call

    kernel = backends.get("nvfp4", "mma_sync_fp4_emulated")
    run = kernel.make_launcher(Probe(), kernel)
    bounds, T, H = (0, 100, 300), 300, 2
    q, k, v = _inputs(T, H, seed=1)
    plan = Plan.create(build_host_plan(bounds), H, CPU)
    views = wsmod.captured_views(wsmod.layout_for("nvfp4", T, H, 2), CPU)
    run(q, k, v, torch.empty_like(q), 0.1, bounds, plan, views)
    assert set(errors) == {"quantize_nvfp4", "attention_nvfp4"}
    assert all("CUDA tensor" in msg for msg in errors.values()), errors


def test_nvfp4_fp16_layout_and_window_key_order() -> None:
    from flashinfer_h3.layout import V_KEY_PAD, nvfp4_fp16_layout, vkeys_cap, window_key_at

    keys = [window_key_at(p) for p in range(V_KEY_PAD)]
    assert sorted(keys) == list(range(V_KEY_PAD))  # a permutation of every window
    assert [window_key_at(p + 64) for p in range(8)] == [0, 1, 16, 17, 32, 33, 48, 49]
    # each thread t of a wgmma quad holds positions 8i + 2t + e: keys 16t .. 16t + 15, one group
    for t in range(4):
        assert sorted(window_key_at(8 * i + 2 * t + e) for i in range(8) for e in range(2)) == \
            list(range(16 * t, 16 * t + 16))
    base = nvfp4_layout(1000, 3, 4)
    full = nvfp4_fp16_layout(1000, 3, 4)
    # The means as in the NVFP4 layout, then the FP16 operands the pre-pass writes (no codes).
    assert [r.name for r in full.regions] == ["kbar", "qbar", "q_f16", "k_f16", "v_f16",
                                              "item_counter"]
    for name in ("kbar", "qbar"):
        assert (full[name].shape, full[name].dtype) == (base[name].shape, base[name].dtype)
    nvk = vkeys_cap(1000, 4)
    assert full["k_f16"].shape == (3, nvk, 128) and full["v_f16"].shape == (3, 128, nvk)
    assert full["q_f16"].shape == (3, 1000, 128) and full["q_f16"].dtype == torch.float16
    assert all(r.offset % 256 == 0 for r in full.regions)
    fp16_bytes = 2 * 3 * 128 * (1000 + 2 * nvk)
    assert full.total_bytes >= base["kbar"].nbytes + base["qbar"].nbytes + fp16_bytes
    assert full.total_bytes < base.total_bytes + fp16_bytes  # the codes' bytes are gone


def test_workspace_bytes_per_backend() -> None:
    from flashinfer_h3.layout import nvfp4_fp16_layout

    T, H, S = 5000, 3, 4
    base = nvfp4_layout(T, H, S).total_bytes
    hopper = nvfp4_fp16_layout(T, H, S).total_bytes
    assert flashinfer_h3.workspace_bytes_nvfp4(T, H, S, backend="wgmma_fp16_nvfp4") == hopper
    assert flashinfer_h3.workspace_bytes_nvfp4(T, H, S, backend="mma_sync_fp4") == base
    assert flashinfer_h3.workspace_bytes_nvfp4(T, H, S, backend="reference") == 0
    # The Hopper FP8 kernel's layout: the FP8 regions and its item counter.
    from flashinfer_h3.layout import fp8_layout, fp8_sm90_layout

    assert flashinfer_h3.workspace_bytes_fp8(T, H, S, backend="wgmma_fp8") == \
        fp8_sm90_layout(T, H, S).total_bytes
    assert flashinfer_h3.workspace_bytes_fp8(T, H, S, backend="mma_sync_fp8") == \
        fp8_layout(T, H, S).total_bytes
    hopper8 = fp8_sm90_layout(T, H, S)
    assert [r.name for r in hopper8.regions][:-1] == [r.name for r in fp8_layout(T, H, S).regions]
    assert hopper8["item_counter"].shape == (1,) and hopper8["item_counter"].dtype == torch.int32
    assert nvfp4_fp16_layout(T, H, S)["item_counter"].shape == (1,)
    if not torch.cuda.is_available():  # no GPU: the operator's own layout
        assert flashinfer_h3.workspace_bytes_nvfp4(T, H, S) == base
        assert flashinfer_h3.workspace_bytes_nvfp4(T, H, S, backend="auto") == base
    with pytest.raises(ValueError, match="not a nvfp4 backend"):
        flashinfer_h3.workspace_bytes_nvfp4(T, H, S, backend="fast")
    with pytest.raises(ValueError, match="num_heads"):
        flashinfer_h3.workspace_bytes_nvfp4(T, 0, S, backend="wgmma_fp16_nvfp4")
