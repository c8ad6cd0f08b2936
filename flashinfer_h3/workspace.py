"""Workspaces: the device memory that holds a call's quantized operands.

One flat ``uint8`` buffer serves both operators; ``layout.py`` says where each region lives.

- Eager calls use a **grow-only** buffer per ``(device, stream)``: it is replaced by a larger one
  only when a call needs more bytes than it has, and never shrinks (``release_workspaces`` drops
  them all). Kernels of one stream run in order, so consecutive calls on a stream can share it;
  calls on two streams never share memory. When a buffer is replaced, the caching allocator
  reuses the old one only for later work on the same stream, so in-flight kernels are safe.
- The typed views of a buffer (one tensor per region) are cached per ``(layout, buffer)``, so a
  call with a known shape builds nothing.
- A call made while a CUDA graph is being captured gets a fresh buffer of exactly the layout's
  size, allocated inside the capture: it comes from the graph's private memory pool, which
  the graph keeps until it is destroyed, so every replay finds it (and nothing else is given
  that memory, except later allocations of captures that share the pool, as torch documents
  for ``pool=``). Eager workspaces are never captured into a graph.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict

import torch

from .layout import WorkspaceLayout, fp8_layout, nvfp4_layout

GROW_GRANULE = 2 << 20  # eager buffers are rounded up to 2 MiB (the allocator's large pages)
VIEW_CACHE_SIZE = 64  # cached layouts per workspace

_LAYOUTS = {"nvfp4": nvfp4_layout, "fp8": fp8_layout}


@functools.lru_cache(maxsize=1024)
def layout_for(op: str, tokens: int, heads: int, segments: int) -> WorkspaceLayout:
    """The (cached) workspace layout of ``op`` ("nvfp4" or "fp8") for these counts."""
    try:
        make = _LAYOUTS[op]
    except KeyError:
        raise ValueError(f"op must be one of {sorted(_LAYOUTS)}, got {op!r}") from None
    return make(tokens, heads, segments)


def _views_tuple(layout: WorkspaceLayout, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The region views of ``buffer`` in layout order."""
    return tuple(layout.views(buffer).values())


class Workspace:
    """A grow-only ``uint8`` buffer on one ``(device, stream)`` and its cached region views."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer: torch.Tensor | None = None
        # id(layout) -> (layout, views); holding the layout keeps its id from being reused
        self._views: OrderedDict[int, tuple[WorkspaceLayout, tuple[torch.Tensor, ...]]] = (
            OrderedDict()
        )
        self.grow_count = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def views(self, layout: WorkspaceLayout) -> tuple[torch.Tensor, ...]:
        """Typed views of every region of ``layout`` (growing the buffer if it is too small)."""
        entry = self._views.get(id(layout))
        if entry is not None and entry[0] is layout:
            return entry[1]
        if layout.total_bytes > self.nbytes:
            self._grow(layout.total_bytes)
        assert self.buffer is not None
        views = _views_tuple(layout, self.buffer)
        self._views[id(layout)] = (layout, views)
        if len(self._views) > VIEW_CACHE_SIZE:
            self._views.popitem(last=False)
        return views

    def _grow(self, nbytes: int) -> None:
        size = -(-max(nbytes, 1) // GROW_GRANULE) * GROW_GRANULE
        self._views.clear()  # views of the old buffer must not outlive it in the cache
        self.buffer = None  # let the allocator reuse the old block for the new one
        self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.grow_count += 1


_WORKSPACES: dict[tuple[torch.device, int], Workspace] = {}
_LOCK = threading.Lock()


def workspace_for(device: torch.device, stream_key: int) -> Workspace:
    """The eager workspace of ``(device, stream)``; ``stream_key`` is the raw stream handle."""
    key = (device, stream_key)
    ws = _WORKSPACES.get(key)
    if ws is None:
        with _LOCK:
            ws = _WORKSPACES.setdefault(key, Workspace(device))
    return ws


def eager_views(layout: WorkspaceLayout, device: torch.device,
                stream_key: int) -> tuple[torch.Tensor, ...]:
    """Region views of the grow-only workspace of ``(device, stream)`` for ``layout``."""
    return workspace_for(device, stream_key).views(layout)


def captured_views(layout: WorkspaceLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Region views of a buffer owned by the ongoing CUDA graph capture (see module doc)."""
    buffer = torch.empty(max(layout.total_bytes, 1), dtype=torch.uint8, device=device)
    return _views_tuple(layout, buffer)


def workspaces() -> dict[tuple[torch.device, int], Workspace]:
    """A snapshot of the eager workspaces, keyed by ``(device, raw stream handle)``."""
    with _LOCK:
        return dict(_WORKSPACES)


def release_workspaces() -> None:
    """Drop every eager workspace (their memory returns to torch's caching allocator).

    Kernels already queued keep working: torch frees the memory in stream order.
    """
    with _LOCK:
        _WORKSPACES.clear()
