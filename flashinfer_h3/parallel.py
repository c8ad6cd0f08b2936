"""Ulysses sequence parallelism: the operators across the ranks of a ``torch.distributed`` group.

Every rank holds a contiguous shard of one packed sequence, all heads:
``[tokens_local, heads, 128]``. ``ulysses_attention`` all-to-alls to head shards (every token,
``heads / W`` heads), runs the operator there, and all-to-alls back::

    rank r:  q[r*Tl:(r+1)*Tl, :H]   --all_to_all-->   q[0:W*Tl, r*H/W:(r+1)*H/W]
             out[r*Tl:(r+1)*Tl, :H] <--all_to_all--   attention(...)[0:W*Tl, r*H/W:(r+1)*H/W]

Attention is per head, so every rank computes exactly the per-head work of the unsharded call:
the result equals the single-GPU operator (and, with ``attention=`` a reference, that
reference) bit for bit.

Layout and padding rule
-----------------------
- ``cu_seqlens`` (and ``cu_seqlens_host``) are the *global* bounds, identical on every rank.
  Segments may cross shard boundaries and may be empty.
- With ``T = cu_seqlens[-1]`` real tokens and ``W`` ranks, every rank holds
  ``tokens_local = ceil(T / W)`` rows; rank ``r`` holds global rows ``[r*Tl, (r+1)*Tl)``.
  When ``W`` does not divide ``T`` the sequence is padded at its end with ``W*Tl - T < W`` rows
  (the last rows of the last rank(s)); their contents are ignored (they form a segment of their
  own that no real token attends to) and their output rows are zero. ``shard_sequence`` pads
  and cuts a full tensor by this rule; ``gather_sequence`` undoes it.
- To pad further (e.g. each shard to a multiple of 128 rows), make the padding a segment of its
  own in ``cu_seqlens``, so that ``cu_seqlens[-1] == W * tokens_local``.
- ``heads`` must be divisible by ``W``.

Checks
------
Every argument is checked on every rank before any data moves: types, dtypes, shapes, the
bounds, ``heads % W``, ``tokens_local == ceil(T / W)``, the precision and the scale. The ranks
then compare what they were given (tokens, heads, head dim, dtype, the bounds, the scale, the
precision) with one all-gather of a 16-integer signature; a rank whose own check failed takes
part with a failure flag, so a bad argument on one rank raises on every rank (the same
exception type; the failing rank gives the details) and no all-to-all is ever entered with
mismatched shards. The signature travels on the host when the group has a CPU backend
(``gloo``, or ``init_process_group(backend="cpu:gloo,cuda:nccl")``); on a CUDA-only group
(plain ``nccl``) it is a tiny device all-gather read back by the host, one synchronisation per
call. ``FLASHINFER_H3_ULYSSES_CHECK=0`` skips the comparison (local checks only, sync-free);
during CUDA graph capture it runs only on a CPU backend (at capture time).

Communication
-------------
Each tensor goes through one layout transpose into a send buffer, one ``all_to_all_single``
(equal splits; moved as raw bytes, a ``uint8`` view, which every backend supports: gloo has no
int16, old gloo builds no bf16) into a buffer that *is* the operator's contiguous
``[W*Tl, H/W, 128]`` input; the output comes back the same way and one transpose writes the
result. No other copies. The heads of a rank can be split into ``chunks`` groups
(``FLASHINFER_H3_ULYSSES_CHUNKS``, default ``auto``): every chunk has its own all-to-alls and
operator call, issued asynchronously, so the K/V/Q exchange of chunk ``g + 1`` and the return of
chunk ``g - 1`` overlap the attention of chunk ``g`` (per-head work, so results are identical
for every chunk count). ``auto`` is 2 chunks when ``W > 1``, ``H/W`` is even and the call is
large (``W*Tl * H/W >= 2**18`` rows x heads), else 1.

With world size 1 (or ``group=None`` and no initialised process group) the operator is called
directly: no collective and no copy. Without ``cu_seqlens_host`` the bounds are read from
``cu_seqlens`` once (one device-to-host copy, as the operator itself would) and handed on.
The call is capturable into a CUDA graph when the operator is (kernel backends, with
``cu_seqlens_host``; the NCCL all-to-alls are captured with it).
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import diffusion_ops as ops

__all__ = [
    "ENV_CHECK",
    "ENV_CHUNKS",
    "gather_sequence",
    "local_tokens",
    "shard_sequence",
    "ulysses_attention",
]

ENV_CHECK = "FLASHINFER_H3_ULYSSES_CHECK"
ENV_CHUNKS = "FLASHINFER_H3_ULYSSES_CHUNKS"
PRECISIONS = ("nvfp4", "fp8")
_AUTO_CHUNK_ROWS = 1 << 18  # W*Tl * H/W at or above which auto splits the heads in two

Attention = Callable[..., Tensor]

# Signature fields (int64 each) compared across ranks.
_SIG_FIELDS = (
    "magic", "status", "tokens_local", "heads", "head_dim", "dtype", "ndim", "precision",
    "scale", "num_bounds", "bounds_hash", "total_tokens", "chunks", "world", "reserved0",
    "reserved1",
)
_MAGIC = 0x48335553  # "H3US"
_ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, RuntimeError)
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *,
                      group: dist.ProcessGroup | None = None, precision: str = "nvfp4",
                      attention: Attention | None = None,
                      cu_seqlens_host: Sequence[int] | None = None,
                      softmax_scale: float | None = None) -> Tensor:
    """Packed-varlen attention over a sequence sharded across ``group`` (Ulysses SP).

    Args:
        q, k, v: this rank's contiguous shard ``[tokens_local, heads, 128]`` (bf16) of the
            packed sequence: rank ``r`` of ``W`` holds global rows ``[r*Tl, (r+1)*Tl)``,
            ``Tl = ceil(cu_seqlens[-1] / W)`` (the last rank(s) padded at the end, see the
            module doc). ``heads`` divisible by ``W``.
        cu_seqlens: the *global* segment bounds, int32 ``[segments + 1]`` on ``q``'s device,
            the same on every rank; segments may cross shard boundaries; empty ones are fine.
        group: the process group (default: the world group; with no initialised process group,
            a world of one).
        precision: ``"nvfp4"`` (``minimax_h3_sm120_varlen_attention_nvfp4``) or ``"fp8"``.
        attention: overrides the per-rank operator: called as
            ``attention(q, k, v, cu_seqlens, cu_seqlens_host=..., softmax_scale=...)`` on
            ``[W*Tl, heads/W, 128]`` tensors and returning ``[W*Tl, heads/W, D]`` (e.g.
            ``flashinfer_h3.reference.varlen_attention_nvfp4_reference`` on CPU tensors).
            ``precision`` is then only validated.
        cu_seqlens_host: optional host copy of the global ``cu_seqlens`` (sync-free calls;
            required during CUDA graph capture).
        softmax_scale: as for the operators (default ``1/sqrt(128)``).

    Returns:
        This rank's shard of the output, ``[tokens_local, heads, D]`` (bf16 for the operators);
        padding rows are zero.

    Raises:
        TypeError / ValueError / RuntimeError: on every rank, before any all-to-all, when an
        argument is malformed on any rank or the ranks disagree (see the module doc).
    """
    return _ulysses(q, k, v, cu_seqlens, group=group, precision=precision, attention=attention,
                    cu_seqlens_host=cu_seqlens_host, softmax_scale=softmax_scale)


def local_tokens(total_tokens: int, world_size: int) -> int:
    """Rows per rank for ``total_tokens`` real tokens on ``world_size`` ranks: ``ceil(T / W)``."""
    if world_size < 1 or total_tokens < 0:
        raise ValueError(f"need total_tokens >= 0 and world_size >= 1, got {total_tokens}, "
                         f"{world_size}")
    return -(-total_tokens // world_size)


def shard_sequence(x: Tensor, *, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's contiguous shard of a full ``[T, ...]`` tensor by the padding rule (rows past
    ``T`` zero). A helper for examples and tests; a model normally shards once, up front."""
    rank, world = _rank_world(group)
    tl = local_tokens(x.shape[0], world)
    lo, hi = min(rank * tl, x.shape[0]), min((rank + 1) * tl, x.shape[0])
    if hi - lo == tl:
        return x[lo:hi].contiguous()
    shard = x.new_zeros((tl, *x.shape[1:]))
    shard[: hi - lo] = x[lo:hi]
    return shard


def gather_sequence(x_local: Tensor, total_tokens: int, *,
                    group: dist.ProcessGroup | None = None) -> Tensor:
    """The full ``[total_tokens, ...]`` tensor from every rank's shard (``all_gather``; padding
    rows dropped). Every rank gets the whole tensor."""
    _, world = _rank_world(group)
    if world == 1:
        return x_local[:total_tokens]
    full = x_local.new_empty((world * x_local.shape[0], *x_local.shape[1:]))
    _all_gather_single(_as_bytes(full), _as_bytes(x_local.contiguous()), group=group)
    return full[:total_tokens]


# ---------------------------------------------------------------------------------------------
# One call
# ---------------------------------------------------------------------------------------------


def _ulysses(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *,
             group: dist.ProcessGroup | None, precision: str, attention: Attention | None,
             cu_seqlens_host: Any, softmax_scale: Any, chunks: int | None = None,
             force_collectives: bool = False) -> Tensor:
    """``ulysses_attention`` with two knobs for tests and benchmarks: ``chunks`` (head groups,
    overriding the env/auto choice) and ``force_collectives`` (run the all-to-alls even at
    world size 1, to exercise and time them on one GPU)."""
    rank, world = _rank_world(group)
    distributed = world > 1 or force_collectives
    # Local checks: an exception is held (not raised) until every rank has reported.
    error: Exception | None = None
    call: _Call | None = None
    try:
        call = _check_local(q, k, v, cu_seqlens, world, precision, attention, cu_seqlens_host,
                            softmax_scale, chunks)
    except Exception as exc:  # noqa: BLE001 (every rank must report before anyone raises)
        error = exc
    if distributed and _check_enabled():
        _compare_across_ranks(group, rank, world, call, error, q)
    if error is not None:
        raise error
    assert call is not None
    if not distributed:
        return call.fn(q, k, v, cu_seqlens, cu_seqlens_host=call.bounds,
                       softmax_scale=softmax_scale)
    return _run(call, q, k, v, cu_seqlens, group, world, rank, softmax_scale)


class _Call:
    """What the checks established for one call."""

    __slots__ = ("bounds", "chunks", "fn", "heads", "precision", "scale", "tokens_local",
                 "total")

    def __init__(self, fn: Attention, bounds: tuple[int, ...], tokens_local: int, heads: int,
                 total: int, scale: float, chunks: int, precision: str) -> None:
        self.fn, self.bounds, self.tokens_local, self.heads = fn, bounds, tokens_local, heads
        self.total, self.scale, self.chunks, self.precision = total, scale, chunks, precision


def _check_local(q: Any, k: Any, v: Any, cu_seqlens: Any, world: int, precision: Any,
                 attention: Any, cu_seqlens_host: Any, softmax_scale: Any,
                 chunks: int | None) -> _Call:
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a str ('nvfp4' or 'fp8'), got "
                        f"{type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be 'nvfp4' or 'fp8', got {precision!r}")
    if attention is not None and not callable(attention):
        raise TypeError(f"attention must be callable or None, got {type(attention).__name__}")
    scale = ops.check_softmax_scale(softmax_scale)
    tokens_local, heads = ops.check_tensors(q, k, v, cu_seqlens, None)
    if heads % world:
        raise ValueError(f"q has {heads} heads, which the group's world size {world} does not "
                         "divide (each rank runs heads / world_size heads of every token)")
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if cu_seqlens_host is None:
        if capturing:
            raise ValueError(
                "cu_seqlens_host is required while a CUDA graph is being captured (reading "
                "cu_seqlens on the host would synchronise); pass cu_seqlens_host=<list of ints>"
            )
        name, raw = "cu_seqlens", tuple(cu_seqlens.tolist())  # the one D2H copy
    else:
        name, raw = "cu_seqlens_host", ops._as_host_tuple(cu_seqlens_host)
        if len(raw) != cu_seqlens.shape[0]:
            raise ValueError(f"cu_seqlens_host has {len(raw)} entries, expected "
                             f"{cu_seqlens.shape[0]} (the length of cu_seqlens)")
    try:
        last = operator.index(raw[-1]) if raw else 0
    except TypeError:
        last = 0  # check_bounds names the offending entry
    bounds = ops.check_bounds(raw, last, name)
    total = bounds[-1]
    expected = local_tokens(total, world)
    if tokens_local != expected:
        raise ValueError(
            f"q has {tokens_local} tokens on this rank, expected ceil({name}[-1] / world_size) "
            f"= ceil({total} / {world}) = {expected}: {name} are the global bounds, and every "
            "rank holds the same number of rows of the packed sequence (padded at its end; "
            "see flashinfer_h3.parallel)"
        )
    n = _chunks(chunks, heads // world, world * tokens_local, world)
    if attention is None:
        ops.check_cuda(q)
        backend = ops._backend(precision, q.device)  # RuntimeError: GPU, toolchain
        if capturing and not backend.capturable:
            raise RuntimeError(ops._NOT_CAPTURABLE[precision])
        fn: Attention = (ops.minimax_h3_sm120_varlen_attention_nvfp4 if precision == "nvfp4"
                         else ops.minimax_h3_sm120_varlen_attention_fp8)
    else:
        fn = attention
    return _Call(fn, bounds, tokens_local, heads, total, scale, n, precision)


def _chunks(chunks: int | None, heads_per_rank: int, rows: int, world: int) -> int:
    if chunks is None:
        env = os.environ.get(ENV_CHUNKS, "auto").strip().lower() or "auto"
        if env == "auto":
            big = rows * heads_per_rank >= _AUTO_CHUNK_ROWS
            return 2 if world > 1 and heads_per_rank % 2 == 0 and big else 1
        try:
            chunks = int(env)
        except ValueError:
            raise ValueError(f"{ENV_CHUNKS}={env!r}: expected 'auto' or a positive int") from None
        source = f"{ENV_CHUNKS}={env}"
    else:
        source = f"chunks={chunks}"
    if chunks < 1 or heads_per_rank % chunks:
        raise ValueError(f"{source}: the chunk count must be >= 1 and divide the heads per rank "
                         f"({heads_per_rank})")
    return chunks


def _check_enabled() -> bool:
    return os.environ.get(ENV_CHECK, "1").strip().lower() not in ("0", "false", "off", "no")


def _rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError("group was given but torch.distributed is not initialised")
        return 0, 1
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    return rank, dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# Cross-rank comparison (one all-gather of a 16-integer signature; before any all-to-all)
# ---------------------------------------------------------------------------------------------


def _signature(call: _Call | None, error: Exception | None, q: Any, world: int) -> list[int]:
    sig = dict.fromkeys(_SIG_FIELDS, 0)
    sig["magic"], sig["world"] = _MAGIC, world
    if error is not None or call is None:
        kinds = [i for i, t in enumerate(_ERRORS) if isinstance(error, t)]
        sig["status"] = 1 + (kinds[0] if kinds else len(_ERRORS) - 1)
        return [sig[f] for f in _SIG_FIELDS]
    digest = hashlib.blake2b(array("q", call.bounds).tobytes(), digest_size=8).digest()
    sig.update(
        tokens_local=call.tokens_local, heads=call.heads, head_dim=q.shape[2],
        dtype=_DTYPE_CODES.get(q.dtype, 99), ndim=q.dim(),
        precision=PRECISIONS.index(call.precision),
        scale=struct.unpack("<q", struct.pack("<d", call.scale))[0],
        num_bounds=len(call.bounds), total_tokens=call.total, chunks=call.chunks,
        bounds_hash=struct.unpack("<q", digest)[0],
    )
    return [sig[f] for f in _SIG_FIELDS]


def _has_cpu_backend(config: str) -> bool:
    """Whether a backend config (``"cpu:gloo,cuda:nccl"``, ``"cuda:nccl"``, or a bare backend
    name from old torch: ``"gloo"``, ``"nccl"``) takes CPU tensors."""
    config = config.strip().lower()
    if ":" not in config:
        return config in ("gloo", "mpi")
    return any(part.split(":")[0].strip() == "cpu" for part in config.split(","))


def _signature_device(group: dist.ProcessGroup | None, q: Any) -> torch.device | None:
    """Where the signature travels: the host when the group has a CPU backend, else the GPU
    (``None``: no way to compare during a CUDA graph capture)."""
    try:
        config = dist.get_backend_config(group)
    except Exception:  # noqa: BLE001 (old torch or an unusual group: use its backend name)
        config = str(dist.get_backend(group))
    if _has_cpu_backend(config):
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    if isinstance(q, Tensor) and q.device.type == "cuda":
        return q.device
    return torch.device("cuda", torch.cuda.current_device())


def _compare_across_ranks(group: dist.ProcessGroup | None, rank: int, world: int,
                          call: _Call | None, error: Exception | None, q: Any) -> None:
    device = _signature_device(group, q)
    if device is None:
        return
    mine = torch.tensor(_signature(call, error, q, world), dtype=torch.int64).to(device)
    gathered = torch.empty(world * mine.shape[0], dtype=torch.int64, device=device)
    _all_gather_single(gathered, mine, group=group)
    rows = gathered.view(world, -1).tolist()  # on a CUDA-only group: the one sync of the check
    if error is not None:
        return  # this rank raises its own, more precise error
    failed = [r for r, row in enumerate(rows) if row[1] != 0]
    if failed:
        kind = _ERRORS[max(0, min(rows[failed[0]][1] - 1, len(_ERRORS) - 1))]
        others = f" (and rank(s) {', '.join(map(str, failed[1:]))})" if failed[1:] else ""
        raise kind(f"ulysses_attention: rank {failed[0]}{others} of the group rejected its "
                   "arguments (its own error names the argument); nothing was communicated")
    for r, row in enumerate(rows):
        if row[0] != _MAGIC:
            raise RuntimeError(f"ulysses_attention: rank {r} sent no ulysses signature (another "
                               "collective is running on the group at the same time?)")
        diff = [i for i, (a, b) in enumerate(zip(row, rows[rank], strict=True)) if a != b]
        if diff:
            raise ValueError(_mismatch(_SIG_FIELDS[diff[0]], rank, rows[rank][diff[0]], r,
                                       row[diff[0]]))


_MISMATCH = {
    "tokens_local": "q has {a} tokens on rank {ra} but {b} on rank {rb}: every rank holds "
                    "ceil(T / world_size) rows of the packed sequence",
    "heads": "q has {a} heads on rank {ra} but {b} on rank {rb}",
    "head_dim": "q has head dim {a} on rank {ra} but {b} on rank {rb}",
    "dtype": "q's dtype differs between rank {ra} and rank {rb}",
    "ndim": "q's rank (number of dims) differs between rank {ra} and rank {rb}",
    "precision": "precision differs between rank {ra} and rank {rb}",
    "scale": "softmax_scale differs between rank {ra} and rank {rb}",
    "num_bounds": "cu_seqlens has {a} entries on rank {ra} but {b} on rank {rb}: pass the "
                  "global bounds on every rank",
    "bounds_hash": "cu_seqlens differs between rank {ra} and rank {rb}: pass the same global "
                   "bounds on every rank",
    "total_tokens": "cu_seqlens[-1] is {a} on rank {ra} but {b} on rank {rb}",
    "chunks": f"the chunk count ({ENV_CHUNKS}) is {{a}} on rank {{ra}} but {{b}} on rank {{rb}}",
}


def _mismatch(field: str, ra: int, a: int, rb: int, b: int) -> str:
    text = _MISMATCH.get(field, "the ranks' arguments differ (" + field + ")")
    return "ulysses_attention: " + text.format(a=a, b=b, ra=ra, rb=rb) + \
        "; nothing was communicated"


# ---------------------------------------------------------------------------------------------
# Communication and the per-rank operator
# ---------------------------------------------------------------------------------------------


# ``all_gather_into_tensor`` is called ``all_gather_single`` from torch 2.13 on.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _as_bytes(t: Tensor) -> Tensor:
    """A contiguous tensor as ``uint8`` rows (the all-to-alls only move data)."""
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _a2a(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> Any:
    return dist.all_to_all_single(_as_bytes(out), _as_bytes(inp), group=group, async_op=True)


def _run(call: _Call, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
         group: dist.ProcessGroup | None, world: int, rank: int, softmax_scale: Any) -> Tensor:
    tl, heads, d = call.tokens_local, call.heads, q.shape[2]
    rows, hc = world * tl, heads // world // call.chunks
    n = call.chunks
    if rows == 0:
        return q.new_zeros((0, heads, d))
    bounds, cu = call.bounds, cu_seqlens
    if call.total < rows:  # padding rows: a segment of their own, never seen by a real token
        bounds = (*bounds, rows)
        cu = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), rows)])
    # To head shards. Send chunk g for rank j: heads j*H/W + g*hc ... of this rank's tokens.
    # The receive buffer [W, Tl, hc, d] is the operator's [W*Tl, hc, d] input (global order).
    # Every buffer a collective reads or writes stays referenced here until that collective's
    # wait(), so the caching allocator never hands it to another kernel while it is in flight
    # (whatever the backend's own record-stream / stashing policy).
    sends = [x.view(tl, world, n, hc, d) for x in (q, k, v)]
    forward: list[Any] = []
    for g in range(n):
        works, bufs, recvs = [], [], []
        for x in sends:
            buf = torch.empty((world, tl, hc, d), dtype=x.dtype, device=x.device)
            buf.copy_(x[:, :, g].transpose(0, 1))  # layout transpose 1
            recv = torch.empty((rows, hc, d), dtype=x.dtype, device=x.device)
            works.append(_a2a(recv, buf, group))
            bufs.append(buf)
            recvs.append(recv)
        forward.append((works, bufs, recvs))
    backward = []
    for g in range(n):
        works, bufs, (qg, kg, vg) = forward[g]
        forward[g] = None
        for w in works:
            w.wait()
        del works, bufs  # the send buffers, once received (stream-ordered after the wait)
        o = call.fn(qg, kg, vg, cu, cu_seqlens_host=bounds, softmax_scale=softmax_scale)
        if not isinstance(o, Tensor) or o.dim() != 3 or tuple(o.shape[:2]) != (rows, hc):
            raise RuntimeError(f"attention returned {getattr(o, 'shape', type(o).__name__)}, "
                               f"expected [{rows}, {hc}, head_dim]")
        o = o.contiguous()
        back = torch.empty((world, tl, hc, o.shape[2]), dtype=o.dtype, device=o.device)
        backward.append((_a2a(back, o, group), o, back))
    out = None
    for g, (work, _o, back) in enumerate(backward):
        if out is None:
            out = torch.empty((tl, heads, back.shape[3]), dtype=back.dtype, device=back.device)
        work.wait()
        out.view(tl, world, n, hc, -1)[:, :, g].copy_(back.transpose(0, 1))  # transpose 2
    assert out is not None
    backward.clear()
    first_pad = min(max(call.total - rank * tl, 0), tl)
    if first_pad < tl:
        out[first_pad:].zero_()
    return out
