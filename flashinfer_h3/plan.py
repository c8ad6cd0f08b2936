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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .layout import Q_BLOCK, V_KEY_PAD

PLAN_CACHE_SIZE = 512


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
        return sum((b - a) ** 2 for a, b in zip(self.bounds[:-1], self.bounds[1:]))


def build_host_plan(bounds: Sequence[int]) -> HostPlan:
    """Tables of a validated, non-decreasing ``cu_seqlens`` starting at 0."""
    bounds = tuple(int(b) for b in bounds)
    vkey_start, qblock_start = [0], [0]
    blocks = []  # (segment, begin, end, canonical)
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        length = b - a
        vkey_start.append(vkey_start[-1] + -(-length // V_KEY_PAD) * V_KEY_PAD)
        nblk = -(-length // Q_BLOCK)
        for g in range(nblk):
            blocks.append((s, a + g * Q_BLOCK, min(a + (g + 1) * Q_BLOCK, b), qblock_start[-1] + g))
        qblock_start.append(qblock_start[-1] + nblk)
    seg_len = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    schedule = sorted(blocks, key=lambda blk: (-seg_len[blk[0]], blk[0], blk[3]))
    return HostPlan(bounds, tuple(vkey_start), tuple(qblock_start), tuple(schedule))


@dataclass
class Plan:
    """A host plan plus its tables on one device (uploaded once, reused by every call)."""

    host: HostPlan
    device: torch.device
    heads: int
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    _pinned: torch.Tensor | None = None  # keeps the async upload's source alive

    @classmethod
    def create(cls, host: HostPlan, heads: int, device: torch.device) -> Plan:
        S, nqb = host.num_segments, host.num_qblocks
        flat = list(host.bounds) + list(host.vkey_start) + list(host.qblock_start)
        for blk in host.qblocks:
            flat.extend(blk)
        cpu = torch.tensor(flat, dtype=torch.int32)
        if device.type == "cuda":
            cpu = cpu.pin_memory()
            dev = cpu.to(device, non_blocking=True)
        else:
            dev = cpu
        n = S + 1
        tables = {
            "seg_bounds": dev[0:n],
            "vkey_start": dev[n : 2 * n],
            "qblock_start": dev[2 * n : 3 * n],
            "qblocks": dev[3 * n :].view(nqb, 4),
        }
        return cls(host, device, heads, tables, cpu if device.type == "cuda" else None)


class PlanCache:
    """LRU cache of plans keyed by ``(cu_seqlens bounds, heads, device)``."""

    def __init__(self, capacity: int = PLAN_CACHE_SIZE) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()

    def get(self, bounds: Sequence[int], heads: int, device: torch.device) -> Plan:
        key = (tuple(bounds), heads, device)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = Plan.create(build_host_plan(bounds), heads, device)
        self._plans[key] = plan
        if len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()
