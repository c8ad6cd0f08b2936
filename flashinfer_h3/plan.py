"""The segment plan of a call: host-side tables derived from ``cu_seqlens`` and their device copy.

Device tables (all ``int32``, views of one device buffer, read by the kernels):

=============  ==============  =============================================================
name           shape           contents
=============  ==============  =============================================================
seg_bounds     [S + 1]         ``cu_seqlens``: segment ``s`` is rows/keys ``[b[s], b[s+1])``
vkey_start     [S + 1]         padded transposed-V column where segment ``s`` starts
                               (``vkey_start[s+1] - vkey_start[s] = ceil(L_s / 64) * 64``)
qblock_start   [S + 1]         canonical index of segment ``s``'s first 128-row block
qblocks        [NQB, 4]        one row per 128-row block, in *schedule order* (longest segment
                               first, ties by segment index, then block index):
                               ``(segment, row_begin, row_end, canonical_index)``
cta_begin      [G + 1]         CUDA plans only: the static item order of the Hopper FP8 kernel
cta_items      [NQB * heads]   (:func:`item_schedule`): CTA ``b`` of its ``G`` runs items
                               ``cta_items[cta_begin[b]:cta_begin[b + 1]]`` in that order
=============  ==============  =============================================================

An *item* is one (128-row block, head): item ``w`` is block ``w % NQB`` (schedule order) of head
``w // NQB``. (The FP8 kernel's benchmark build with clusters of two CTAs takes another schedule,
:meth:`Plan.schedule_for`: :func:`block_pairs` dealt to clusters, ``cta_items`` of
``2 * NQB * heads`` entries.)

``NQB = qblock_start[S]`` is the number of non-empty 128-row blocks (``<= layout.q_blocks_cap``).
Empty segments own no block and no V column.

Where the device tables live
----------------------------
- Eager calls use :data:`PLANS`, an LRU cache keyed by ``(bounds, heads, device)``. A plan is
  uploaded once, asynchronously, from pinned memory on the stream of the call that created it;
  a call on another stream first makes its stream wait for that upload (an event, no host sync).
  Its device buffer is allocated outside any CUDA graph memory pool
  (:func:`flashinfer_h3.workspace.cache_empty`), so a plan first made while torch.compile's
  cudagraph trees warm up (allocations routed to their pool) never pins graph memory.
- A call made while a CUDA graph is being captured never reads or fills :data:`PLANS`: its
  tables are built on the device from the call's ``cu_seqlens`` tensor by capturable torch ops
  (:func:`device_flat_tables`; the host bounds only fix the shapes). They are temporaries of
  the call, allocated from the capture's pool and freed when it returns, like any op's
  intermediates: stream order makes every replay rebuild them before the kernels read them.
  Nothing on the host is read by a replay (no host buffer has to outlive the capture).
"""

from __future__ import annotations

import functools
import heapq
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import Q_BLOCK, V_KEY_PAD
from .workspace import cache_empty

PLAN_CACHE_SIZE = 512
TABLE_NAMES = ("seg_bounds", "vkey_start", "qblock_start", "qblocks")
#: The cost model of :func:`item_schedule`: an item of a segment of L keys costs
#: ``ceil(L / SCHEDULE_TILE_KEYS) + SCHEDULE_ITEM_COST`` units, the Hopper FP8 kernel's 256-key
#: KV tiles plus what an item's start and end cost it (its first QK^T and last PV run without the
#: other GEMM beside them, the epilogue, the next item's table and scale loads), about two tiles.
SCHEDULE_TILE_KEYS = 256
SCHEDULE_ITEM_COST = 2
#: CTAs of a cluster of the production Hopper FP8 kernel, whose schedule every plan carries: 1.
#: The benchmark build ``cluster_ctas=2`` runs pairs of query blocks of one segment and head that
#: share every K/V tile copy (templates/include/attention/sm90/tile_scheduler.cuh); it measured
#: no faster (benchmarks/RESULTS.md, twelfth session) and takes :meth:`Plan.schedule_for`'s.
FP8_CLUSTER_CTAS = 1
#: The flag of a pair's second entry that has no block of its own (a segment's odd last block):
#: that CTA runs the tiles for the shared copies and stores nothing (kNoRows in the kernel).
NO_ROWS = 1 << 30


@dataclass(frozen=True)
class HostPlan:
    bounds: tuple[int, ...]
    vkey_start: tuple[int, ...]
    qblock_start: tuple[int, ...]
    qblocks: tuple[tuple[int, int, int, int], ...]  # schedule order

    @property
    def tokens(self) -> int:
        return self.bounds[-1]

    @property
    def num_segments(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_qblocks(self) -> int:
        return len(self.qblocks)

    @property
    def sum_sq_lengths(self) -> int:
        """``sum L^2``: attention FLOPs are ``4 * sum_sq_lengths * heads * 128``."""
        return sum((b - a) ** 2 for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True))

    def flat_tables(self) -> list[int]:
        """The four tables concatenated in :data:`TABLE_NAMES` order (the device buffer)."""
        flat = list(self.bounds) + list(self.vkey_start) + list(self.qblock_start)
        for blk in self.qblocks:
            flat.extend(blk)
        return flat


def block_pairs(host: HostPlan, heads: int) -> list[tuple[int, int]]:
    """The FP8 kernel's units of work with clusters of two CTAs, in item order: each pair of
    consecutive blocks of one segment and head as two items, the second flagged :data:`NO_ROWS`
    (and equal to the first) where a segment's block count is odd."""
    nqb = host.num_qblocks
    pairs = []
    for h in range(heads):
        for b, (seg, _, _, canonical) in enumerate(host.qblocks):
            g = canonical - host.qblock_start[seg]
            if g % 2:
                continue
            w = h * nqb + b
            last = canonical + 1 >= host.qblock_start[seg + 1]
            pairs.append((w, w | NO_ROWS if last else w + 1))
    return pairs


def item_schedule(host: HostPlan, heads: int, ctas: int, cluster_ctas: int = 1) -> list[int]:
    """The static item order of ``ctas`` persistent CTAs: ``cta_begin`` (``ctas + 1`` offsets)
    followed by ``cta_items`` (every item once), as one list.

    ``cluster_ctas = 2`` (:data:`FP8_CLUSTER_CTAS`, ``ctas`` even): the units dealt are the
    :func:`block_pairs`, to the ``ctas / 2`` clusters, each pair costing one item; CTAs ``2c`` and
    ``2c + 1`` get runs of the same length, entry ``j`` of each one block of the cluster's ``j``-th
    pair; ``cta_items`` is padded with zeros to ``2 * NQB * heads`` entries.

    Items are dealt in item order (head-major, longest segment first within a head), each to the
    CTA with the least work so far (ties: the lowest index), under the cost model above: what
    the dynamic order of the NVFP4 kernel does at run time, without its atomics and hand-off. So
    the CTAs running at one time still share one or two heads' K and V through L2, and their
    last items end together: on h3-mix's packed lengths the CTA with the most work has 0.1 %
    more than the mean, against 1.3 % for striding (CTA b taking b, b + G, ...); on equal items
    both orders are the same. Once per plan (cached): 27-40 ms of host time at 26,880-39,200
    items.
    """
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    if cluster_ctas not in (1, 2) or ctas % cluster_ctas:
        raise ValueError(f"cluster_ctas must be 1 or 2 and divide ctas = {ctas}, "
                         f"got {cluster_ctas}")
    nqb = host.num_qblocks
    lengths = [host.bounds[s + 1] - host.bounds[s] for s in range(host.num_segments)]
    cost = [-(-lengths[blk[0]] // SCHEDULE_TILE_KEYS) + SCHEDULE_ITEM_COST for blk in host.qblocks]
    if cluster_ctas == 2:
        clusters = ctas // 2
        pair_runs: list[list[tuple[int, int]]] = [[] for _ in range(clusters)]
        heap = [(0, c) for c in range(clusters)]
        for pair in block_pairs(host, heads):
            work, c = heap[0]
            pair_runs[c].append(pair)
            heapq.heapreplace(heap, (work + cost[pair[0] % nqb], c))
        begin, flat = [0], []
        for run in pair_runs:
            for r in range(2):
                flat.extend(pair[r] for pair in run)
                begin.append(len(flat))
        return begin + flat + [0] * (2 * nqb * heads - len(flat))
    runs: list[list[int]] = [[] for _ in range(ctas)]
    load = [(0, b) for b in range(ctas)]  # a heap of (work so far, CTA)
    for w in range(nqb * heads):
        work, b = load[0]
        runs[b].append(w)
        heapq.heapreplace(load, (work + cost[w % nqb], b))
    begin = [0]
    for run in runs:
        begin.append(begin[-1] + len(run))
    return begin + [w for run in runs for w in run]


def striding_pair_schedule(qblocks: torch.Tensor, qblock_start: torch.Tensor, heads: int,
                           ctas: int) -> torch.Tensor:
    """:func:`item_schedule`'s layout with clusters of two CTAs for striding over the
    :func:`block_pairs` (cluster ``c`` of ``ctas / 2`` takes pairs ``c, c + ctas / 2, ...``),
    computed from the device tables by capturable ops: the pairs' number stays on the device."""
    i64 = torch.int64
    device = qblocks.device
    nqb, clusters = qblocks.shape[0], ctas // 2
    if nqb * heads == 0:
        return torch.zeros(ctas + 1, dtype=torch.int32, device=device)
    seg, canonical = qblocks[:, 0].to(i64), qblocks[:, 3].to(i64)
    starts = qblock_start.to(i64)
    g = canonical - starts.index_select(0, seg)
    lead = (g % 2 == 0).repeat(heads)  # item order: head-major
    last = (canonical + 1 >= starts.index_select(0, seg + 1)).repeat(heads)
    w = torch.arange(nqb * heads, dtype=i64, device=device)
    second = torch.where(last, w | NO_ROWS, w + 1)
    pos = torch.cumsum(lead.to(i64), 0) - 1
    count = pos[-1] + 1  # the number of pairs, on the device
    # Pair p's two items at 2p, 2p + 1; items that lead no pair go to a discarded last slot.
    pairs = torch.zeros(2 * nqb * heads + 1, dtype=i64, device=device)
    dump = torch.full_like(pos, 2 * nqb * heads)
    pairs.index_copy_(0, torch.where(lead, 2 * pos, dump), w)
    pairs.index_copy_(0, torch.where(lead, 2 * pos + 1, dump), second)
    c = torch.arange(clusters, dtype=i64, device=device)
    per_cluster = torch.clamp((count - c + clusters - 1) // clusters, min=0)
    begin = torch.nn.functional.pad(per_cluster.repeat_interleave(2).cumsum(0), (1, 0))
    e = torch.arange(2 * nqb * heads, dtype=i64, device=device)
    cta = torch.searchsorted(begin[1:], e, right=True).clamp_(max=ctas - 1)
    j = e - begin.index_select(0, cta)
    pair = (cta // 2 + clusters * j).clamp_(max=nqb * heads - 1)
    items = pairs.index_select(0, 2 * pair + cta % 2)
    items = torch.where(e < 2 * count, items, torch.zeros_like(items))
    return torch.cat((begin, items)).to(torch.int32)


def striding_schedule(items: int, ctas: int, device: torch.device) -> torch.Tensor:
    """:func:`item_schedule`'s layout for striding (CTA ``b`` takes items ``b, b + ctas, ...``),
    computed on ``device`` by capturable ops from the two sizes alone: the order of a call being
    captured into a CUDA graph, whose tables a replay rebuilds from ``cu_seqlens``
    (:func:`captured_plan`). Every item once for any contents, so the kernel's work is complete."""
    i64 = torch.int64
    b = torch.arange(ctas, dtype=i64, device=device)
    count = (items - b + ctas - 1) // ctas
    begin = torch.nn.functional.pad(count.cumsum(0), (1, 0))
    i = torch.arange(items, dtype=i64, device=device)
    cta = torch.searchsorted(begin[1:], i, right=True)
    order = cta + ctas * (i - begin.index_select(0, cta))
    return torch.cat((begin, order)).to(torch.int32)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def schedule_ctas(host: HostPlan, heads: int, device: torch.device, cluster_ctas: int = 1) -> int:
    """The number of persistent CTAs of the Hopper FP8 kernel on ``device``: one per SM, at most
    one per item (one cluster per pair of blocks with ``cluster_ctas = 2``; and one cluster for a
    plan without items, which launches nothing)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if cluster_ctas == 1:
        units = host.num_qblocks * heads
    else:  # block pairs: half of each segment's blocks, rounded up
        starts = host.qblock_start
        units = heads * sum(-(-(b - a) // 2) for a, b in zip(starts[:-1], starts[1:], strict=True))
    return cluster_ctas * max(1, min(units, _sm_count(index) // cluster_ctas))


def cluster_ctas_of(module: Any) -> int:
    """CTAs of a cluster of a Hopper FP8 build (``attention_fp8_wgmma_cluster_ctas``; 1 for
    modules without it): the schedule its launch needs (:func:`item_schedule`)."""
    if hasattr(module, "attention_fp8_wgmma_cluster_ctas"):
        return int(module.attention_fp8_wgmma_cluster_ctas())
    return 1


def with_schedule(plan: Plan, cluster_ctas: int, striding: bool = False) -> Plan:
    """A copy of a CUDA plan with the FP8 item schedule of a build of ``cluster_ctas`` CTAs a
    cluster (plans carry :data:`FP8_CLUSTER_CTAS`'s): the balanced one (:func:`item_schedule`) or
    striding (a captured call's: :func:`striding_schedule`, :func:`striding_pair_schedule`)."""
    host, heads, device = plan.host, plan.heads, plan.device
    ctas = schedule_ctas(host, heads, device, cluster_ctas)
    if not striding:
        flat = torch.tensor(item_schedule(host, heads, ctas, cluster_ctas), dtype=torch.int32,
                            device=device)
    elif cluster_ctas == 2:
        flat = striding_pair_schedule(plan.tables["qblocks"], plan.tables["qblock_start"], heads,
                                      ctas)
    else:
        flat = striding_schedule(host.num_qblocks * heads, ctas, device)
    tables = {**plan.tables, "cta_begin": flat[: ctas + 1], "cta_items": flat[ctas + 1 :]}
    return Plan(host, device, heads, tables)


def build_host_plan(bounds: Sequence[int]) -> HostPlan:
    """Tables of a validated, non-decreasing ``cu_seqlens`` starting at 0."""
    bounds = tuple(int(b) for b in bounds)
    vkey_start, qblock_start = [0], [0]
    blocks = []  # (segment, begin, end, canonical)
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        length = b - a
        vkey_start.append(vkey_start[-1] + -(-length // V_KEY_PAD) * V_KEY_PAD)
        nblk = -(-length // Q_BLOCK)
        for g in range(nblk):
            blocks.append((s, a + g * Q_BLOCK, min(a + (g + 1) * Q_BLOCK, b), qblock_start[-1] + g))
        qblock_start.append(qblock_start[-1] + nblk)
    seg_len = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    schedule = sorted(blocks, key=lambda blk: (-seg_len[blk[0]], blk[0], blk[3]))
    return HostPlan(bounds, tuple(vkey_start), tuple(qblock_start), tuple(schedule))


def _split_tables(flat: torch.Tensor, host: HostPlan, heads: int = 0) -> dict[str, torch.Tensor]:
    """The tables of ``flat`` (:meth:`HostPlan.flat_tables`, then, where it is longer, the item
    schedule of :func:`item_schedule` for ``heads`` heads)."""
    n = host.num_segments + 1
    end = 3 * n + 4 * host.num_qblocks
    tables = {
        "seg_bounds": flat[0:n],
        "vkey_start": flat[n : 2 * n],
        "qblock_start": flat[2 * n : 3 * n],
        "qblocks": flat[3 * n : end].view(host.num_qblocks, 4),
    }
    if flat.numel() > end:
        ctas = flat.numel() - end - 1 - FP8_CLUSTER_CTAS * host.num_qblocks * heads
        tables["cta_begin"] = flat[end : end + ctas + 1]
        tables["cta_items"] = flat[end + ctas + 1 :]
    return tables


def _stream_key(device: torch.device) -> int:
    """The raw handle of torch's current stream on ``device`` (0 for the CPU)."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index)


@dataclass
class Plan:
    """A host plan plus its tables on one device.

    ``args`` is the tuple ``(seg_bounds, vkey_start, qblock_start, qblocks)`` in the order of the
    kernel signatures. Call :meth:`ready` with the stream about to read the tables.
    """

    host: HostPlan
    device: torch.device
    heads: int
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    _pinned: torch.Tensor | None = None  # keeps the async upload's source alive
    _uploaded: torch.cuda.Event | None = None  # recorded after the upload (CUDA, eager plans)
    _ready_streams: set[int] = field(default_factory=set)  # streams ordered after the upload
    captured: bool = False  # temporaries of a call being captured (never cached)

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        t = self.tables
        return (t["seg_bounds"], t["vkey_start"], t["qblock_start"], t["qblocks"])

    @property
    def schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cta_begin, cta_items)``: the Hopper FP8 kernel's item order (CUDA plans only;
        :func:`item_schedule` for clusters of :data:`FP8_CLUSTER_CTAS`, or striding for a call
        being captured)."""
        if "cta_begin" not in self.tables:
            raise ValueError(f"a plan on {self.device} has no item schedule (CUDA plans only)")
        return self.tables["cta_begin"], self.tables["cta_items"]

    def schedule_for(self, cluster_ctas: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:attr:`schedule` for builds of ``cluster_ctas`` CTAs a cluster: the plan's own for
        :data:`FP8_CLUSTER_CTAS`, else (the benchmark-only clustered build) one made the same way
        (striding for a captured call, balanced otherwise) once and kept with the plan."""
        if cluster_ctas == FP8_CLUSTER_CTAS:
            return self.schedule
        key = f"cta_begin/{cluster_ctas}"
        if key not in self.tables:
            other = with_schedule(self, cluster_ctas, striding=self.captured)
            self.tables[key] = other.tables["cta_begin"]
            self.tables[f"cta_items/{cluster_ctas}"] = other.tables["cta_items"]
        return self.tables[key], self.tables[f"cta_items/{cluster_ctas}"]

    @classmethod
    def create(cls, host: HostPlan, heads: int, device: torch.device) -> Plan:
        """Upload ``host``'s tables to ``device`` on the current stream, without a host sync.

        Not for use during CUDA graph capture (see :func:`captured_plan`).
        """
        if device.type != "cuda":
            cpu = torch.tensor(host.flat_tables(), dtype=torch.int32)
            return cls(host, device, heads, _split_tables(cpu, host))
        ctas = schedule_ctas(host, heads, device, FP8_CLUSTER_CTAS)
        schedule = item_schedule(host, heads, ctas, FP8_CLUSTER_CTAS)
        cpu = torch.tensor(host.flat_tables() + schedule, dtype=torch.int32).pin_memory()
        # A long-lived cache entry: allocated outside any graph memory pool (see cache_empty),
        # on a stream that need not be this one, hence the record_stream (a no-op when it is):
        # after an eviction the allocator must not reuse the block before this stream's reads.
        dev = cache_empty(cpu.numel(), torch.int32, device)
        stream = torch.cuda.current_stream(device)
        dev.copy_(cpu, non_blocking=True)
        dev.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        plan = cls(host, device, heads, _split_tables(dev, host, heads), cpu, event)
        plan._ready_streams.add(_stream_key(device))
        return plan

    def ready(self, stream_key: int) -> None:
        """Make the current stream (handle ``stream_key``) safe to read the tables: it waits
        for the upload, and the allocator will not recycle the tables (after an eviction)
        before the work this stream queues on them has finished."""
        if stream_key in self._ready_streams or self._uploaded is None:
            return
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self._uploaded)
        self.tables["seg_bounds"].record_stream(stream)
        self._ready_streams.add(stream_key)


class PlanCache:
    """LRU cache of plans keyed by ``(cu_seqlens bounds, heads, device)``.

    ``bounds`` must already be validated (``bounds[0] == 0``, non-decreasing ints): a hit means
    they were valid when first seen, so callers may skip re-validating them.
    """

    def __init__(self, capacity: int = PLAN_CACHE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"PlanCache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, bounds: tuple[int, ...], heads: int, device: torch.device) -> Plan | None:
        """The cached plan (marked most recently used), or ``None``; never creates one."""
        key = (bounds, heads, device)
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def get(self, bounds: Sequence[int], heads: int, device: torch.device) -> Plan:
        """The cached plan, created (and the least recently used one evicted) on a miss."""
        bounds = tuple(bounds)
        plan = self.lookup(bounds, heads, device)
        if plan is not None:
            return plan
        plan = Plan.create(build_host_plan(bounds), heads, device)
        key = (bounds, heads, device)
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        return plan

    def __contains__(self, key: tuple) -> bool:
        return key in self._plans

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


PLANS = PlanCache()


def device_flat_tables(cu_seqlens: torch.Tensor, tokens: int, num_qblocks: int) -> torch.Tensor:
    """:meth:`HostPlan.flat_tables` computed on ``cu_seqlens``' device, as one int32 tensor.

    ``num_qblocks`` (NQB, from the host bounds) and ``tokens`` fix every shape, so no op reads
    device memory on the host or copies host data to the device: no sync, nothing pageable, and
    the whole computation can be recorded into a CUDA graph (where a replay recomputes the
    tables from the current contents of ``cu_seqlens``). Bit-identical to the host plan's
    tables for valid bounds that match ``num_qblocks``.

    Contents that do not match the host bounds (``cu_seqlens`` changed before a replay) give
    wrong tables but never out-of-range rows: the bounds are first clamped to ``[0, tokens]``
    and made non-decreasing (a no-op on valid bounds), and surplus blocks become empty ones.
    """
    device = cu_seqlens.device
    n = cu_seqlens.numel()  # S + 1
    segments, nqb = n - 1, num_qblocks
    if nqb and segments < 1:
        raise ValueError(f"num_qblocks = {nqb} needs at least one segment")
    i64 = torch.int64
    # int64 inside: the schedule key below is length * NQB (beyond int32); cast once at the end.
    b = torch.cummax(torch.clamp(cu_seqlens.to(i64), 0, tokens), 0).values
    lengths = b[1:] - b[:-1]
    per_segment = torch.stack((
        lengths,
        (lengths + (V_KEY_PAD - 1)) // V_KEY_PAD * V_KEY_PAD,  # padded V columns
        (lengths + (Q_BLOCK - 1)) // Q_BLOCK,  # 128-row query blocks
    ))
    # Exclusive prefix sums: rows seg_bounds (== b for valid bounds), vkey_start, qblock_start.
    starts = torch.nn.functional.pad(per_segment.cumsum(1), (1, 0))
    flat = torch.empty(3 * n + 4 * nqb, dtype=torch.int32, device=device)
    flat[: 3 * n].copy_(starts.view(-1))
    if nqb == 0:
        return flat
    seg_bounds, qblock_start = starts[0], starts[2]
    canonical = torch.arange(nqb, dtype=i64, device=device)
    # Segment of each canonical block: qblock_start[s] <= c < qblock_start[s + 1] (the clamp
    # only matters when the contents give fewer than NQB blocks).
    seg = torch.searchsorted(qblock_start[1:], canonical, right=True).clamp_(max=segments - 1)
    g = canonical - qblock_start.index_select(0, seg)
    row_begin = seg_bounds.index_select(0, seg) + g * Q_BLOCK
    row_end = torch.minimum(row_begin + Q_BLOCK, seg_bounds[1:].index_select(0, seg))
    row_begin = torch.minimum(row_begin, row_end)  # surplus blocks: empty, still in range
    # Schedule order = longest segment first, then canonical order (segment, block): one
    # unique int64 key per block, so any sort (stable or not) gives the host plan's order.
    order = torch.argsort(canonical - lengths.index_select(0, seg) * nqb)
    rows = torch.stack((seg, row_begin, row_end, canonical), dim=1)
    flat[3 * n :].view(nqb, 4).copy_(rows.index_select(0, order))
    return flat


def captured_plan(bounds: tuple[int, ...], heads: int, cu_seqlens: torch.Tensor) -> Plan:
    """A plan for a call being captured into a CUDA graph (``bounds`` validated and equal to
    ``cu_seqlens``, as the API requires).

    Nothing is added to :data:`PLANS` and nothing outlives the call: the tables are built on the
    device from ``cu_seqlens`` (:func:`device_flat_tables`) into memory of the capture's pool,
    freed when the caller drops the plan. Each replay rebuilds them before the kernels run. Its
    item schedule is striding (:func:`striding_schedule`): the balanced one depends on the
    lengths, which a replay may change, and would have to be uploaded from the host.
    """
    host = build_host_plan(bounds)
    flat = device_flat_tables(cu_seqlens, host.tokens, host.num_qblocks)
    device = cu_seqlens.device
    if device.type == "cuda":
        ctas = schedule_ctas(host, heads, device, FP8_CLUSTER_CTAS)
        n = host.num_segments + 1
        qblocks = flat[3 * n :].view(host.num_qblocks, 4)
        flat = torch.cat((flat, striding_pair_schedule(qblocks, flat[2 * n : 3 * n], heads, ctas)))
    return Plan(host, device, heads, _split_tables(flat, host, heads), captured=True)
