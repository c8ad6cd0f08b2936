"""Workspaces: the device memory that holds a call's quantized operands.

One flat ``uint8`` buffer serves both operators; ``layout.py`` says where each region lives.

- Eager calls use a **grow-only** buffer per ``(device, stream)``: it is replaced by a larger one
  only when a call needs more bytes than it has, and never shrinks (``release_workspaces`` drops
  them all). Kernels of one stream run in order, so consecutive calls on a stream can share it;
  calls on two streams never share memory. The buffer is recorded on its stream
  (``record_stream``), so when it is replaced or released the caching allocator reuses the
  memory only after the kernels queued on it have finished.
- Long-lived buffers (eager workspaces, eager plan tables) come from :func:`cache_empty`, which
  allocates them outside any CUDA graph memory pool (see there): torch.compile's cudagraph trees
  route a warm-up run's allocations to their graph pool, and a cache entry created there would
  pin graph memory that the trees then reuse.
- The typed views of a buffer (one tensor per region) are cached per ``(layout, buffer)``, so a
  call with a known shape builds nothing.
- A call made while a CUDA graph is being captured gets a fresh buffer of exactly the layout's
  size, allocated inside the capture from the graph's private pool and freed when the call
  returns, like any op's intermediates (a replay runs the same kernels in the same stream
  order, so the memory is never read before this call's own pre-pass writes it). Eager
  workspaces are never captured into a graph.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from .layout import WorkspaceLayout, fp8_layout, fp8_sm90_layout, nvfp4_fp16_layout, nvfp4_layout

GROW_GRANULE = 2 << 20  # eager buffers are rounded up to 2 MiB (the allocator's large pages)
VIEW_CACHE_SIZE = 64  # cached layouts per workspace

_LAYOUTS = {"nvfp4": nvfp4_layout, "nvfp4_fp16": nvfp4_fp16_layout, "fp8": fp8_layout,
            "fp8_sm90": fp8_sm90_layout}


@functools.lru_cache(maxsize=1024)
def layout_for(op: str, tokens: int, heads: int, segments: int) -> WorkspaceLayout:
    """The (cached) workspace layout ``op`` ("nvfp4", "nvfp4_fp16", "fp8" or "fp8_sm90") for these
    counts."""
    try:
        make = _LAYOUTS[op]
    except KeyError:
        raise ValueError(f"op must be one of {sorted(_LAYOUTS)}, got {op!r}") from None
    return make(tokens, heads, segments)


T = TypeVar("T")
_ALLOCATOR: ThreadPoolExecutor | None = None
_ALLOCATOR_LOCK = threading.Lock()


_ALLOCATOR_IDENT: int | None = None  # threading.get_ident() of the helper thread


def _mark_allocator_thread() -> None:
    global _ALLOCATOR_IDENT
    _ALLOCATOR_IDENT = threading.get_ident()


def _allocator_thread() -> ThreadPoolExecutor:
    global _ALLOCATOR
    with _ALLOCATOR_LOCK:
        if _ALLOCATOR is None:
            _ALLOCATOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashinfer_h3_alloc",
                                            initializer=_mark_allocator_thread)
        return _ALLOCATOR


def _forget_allocator_thread() -> None:
    global _ALLOCATOR, _ALLOCATOR_IDENT  # a forked child has no such thread: make a new one
    _ALLOCATOR, _ALLOCATOR_IDENT = None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_allocator_thread)


def cache_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(numel)`` for a buffer that outlives the call: never from a graph pool.

    torch's caching allocator routes an allocation to a CUDA graph's private pool while that
    pool is "allocating to": during ``torch.cuda.graph`` capture (filter on the capturing
    stream) and during torch.compile cudagraph-tree warm-up runs
    (``torch/_inductor/cudagraph_trees.py``, ``_use_cuda_memory_pool_manager`` ->
    ``torch._C._cuda_beginAllocateCurrentThreadToPool``: every allocation *of that thread*;
    older torch filtered on the warm-up stream instead). The allocation is therefore made on a
    dedicated helper thread, whose current stream is the device's default stream: neither
    filter matches it. The block then belongs to that stream, so a caller that uses it on
    another stream must ``record_stream`` it there (see ``Workspace._grow`` and ``Plan``).

    Costs a thread hand-off (tens of microseconds, no GPU sync); only plan-cache misses and
    workspace growth come here. Must not be called during a capture (there is no reason to).
    """
    if device.type != "cuda":
        return torch.empty(numel, dtype=dtype, device=device)
    return on_allocator_thread(torch.empty, numel, dtype=dtype, device=device)


def on_allocator_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` run on the helper thread of :func:`cache_empty` (waits for it)."""
    if threading.get_ident() == _ALLOCATOR_IDENT:  # already there: submitting would deadlock
        return fn(*args, **kwargs)
    try:
        future = _allocator_thread().submit(fn, *args, **kwargs)
    except RuntimeError:  # interpreter shutdown: no new threads (and no graph warm-up either)
        return fn(*args, **kwargs)
    return future.result()


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
        """Replace the buffer by one of ``nbytes`` rounded up (called on the workspace's stream:
        the stream current when the view is requested)."""
        size = -(-max(nbytes, 1) // GROW_GRANULE) * GROW_GRANULE
        self._views.clear()  # views of the old buffer must not outlive it in the cache
        self.buffer = None  # freed first: the allocator may reuse it once its uses are done
        buffer = cache_empty(size, torch.uint8, self.device)
        if self.device.type == "cuda":
            # cache_empty's block belongs to the default stream; the kernels of this workspace
            # run on the current one, so the allocator must wait for them before reusing it.
            buffer.record_stream(torch.cuda.current_stream(self.device))
        self.buffer = buffer
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
    """Region views of a temporary buffer of the call being captured (from the capture's
    pool; freed when the caller drops the views; see the module doc)."""
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
