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
=============  ==============  =============================================================

``NQB = qblock_start[S]`` is the number of non-empty 128-row blocks (``<= layout.q_blocks_cap``).
Empty segments own no block and no V column.

Where the device tables live
----------------------------
- Eager calls use :data:`PLANS`, an LRU cache keyed by ``(bounds, heads, device)``. A plan is
  uploaded once, asynchronously, from pinned memory on the stream of the call that created it;
  a call on another stream first makes its stream wait for that upload (an event, no host sync).
- A call made while a CUDA graph is being captured never reads or fills :data:`PLANS`: its
  tables are allocated during the capture (so they belong to the graph's private memory pool,
  alive as long as the graph) and filled by a copy recorded into the graph from an immutable
  host buffer. That host buffer is kept for the life of the process (one per distinct captured
  ``bounds``: a few KB), since a replay reads it again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .layout import Q_BLOCK, V_KEY_PAD

PLAN_CACHE_SIZE = 512
TABLE_NAMES = ("seg_bounds", "vkey_start", "qblock_start", "qblocks")


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


def _split_tables(flat: torch.Tensor, host: HostPlan) -> dict[str, torch.Tensor]:
    n = host.num_segments + 1
    return {
        "seg_bounds": flat[0:n],
        "vkey_start": flat[n : 2 * n],
        "qblock_start": flat[2 * n : 3 * n],
        "qblocks": flat[3 * n :].view(host.num_qblocks, 4),
    }


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
    captured: bool = False  # tables owned by a CUDA graph capture (never cached)

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        t = self.tables
        return (t["seg_bounds"], t["vkey_start"], t["qblock_start"], t["qblocks"])

    @classmethod
    def create(cls, host: HostPlan, heads: int, device: torch.device) -> Plan:
        """Upload ``host``'s tables to ``device`` on the current stream, without a host sync.

        Not for use during CUDA graph capture (see :meth:`create_captured`).
        """
        cpu = torch.tensor(host.flat_tables(), dtype=torch.int32)
        if device.type != "cuda":
            return cls(host, device, heads, _split_tables(cpu, host))
        cpu = cpu.pin_memory()
        dev = cpu.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        plan = cls(host, device, heads, _split_tables(dev, host), cpu, event)
        plan._ready_streams.add(_stream_key(device))
        return plan

    @classmethod
    def create_captured(cls, host: HostPlan, heads: int, device: torch.device,
                        source: torch.Tensor) -> Plan:
        """Tables allocated and filled inside the ongoing CUDA graph capture.

        ``source`` is the CPU int32 copy of ``host.flat_tables()``; the graph reads it again at
        every replay, so the caller must keep it alive (and unchanged) as long as the graph.
        The device buffer comes from the capture's private pool, which the graph keeps.
        """
        dev = torch.empty(source.numel(), dtype=torch.int32, device=device)
        dev.copy_(source, non_blocking=True)
        return cls(host, device, heads, _split_tables(dev, host), captured=True)

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

# Host sources of the tables recorded into CUDA graphs: bounds -> immutable CPU int32 tensor.
_CAPTURE_SOURCES: dict[tuple[int, ...], tuple[HostPlan, torch.Tensor]] = {}
_CAPTURE_LOCK = threading.Lock()


def captured_plan(bounds: tuple[int, ...], heads: int, device: torch.device) -> Plan:
    """A plan for a call being captured into a CUDA graph (``bounds`` validated).

    Nothing is added to :data:`PLANS`. The tables are allocated in the capture's memory pool
    and filled by a host-to-device copy recorded into the graph; its host source is interned
    per ``bounds`` for the life of the process (the pinned buffer of an eager plan when one
    exists, else a pageable one: no pinned allocation happens during the capture).
    """
    with _CAPTURE_LOCK:
        entry = _CAPTURE_SOURCES.get(bounds)
        if entry is None:
            eager = PLANS.lookup(bounds, heads, device)
            if eager is not None and eager._pinned is not None:
                entry = (eager.host, eager._pinned)
            else:
                host = build_host_plan(bounds)
                entry = (host, torch.tensor(host.flat_tables(), dtype=torch.int32))
            _CAPTURE_SOURCES[bounds] = entry
    host, source = entry
    return Plan.create_captured(host, heads, device, source)
