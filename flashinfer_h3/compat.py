"""Drop-in adapters: ``flash_attn_varlen_func`` (flash-attn 2 order) and ``sageattn``
(SageAttention) on top of the flashinfer_h3 operators.

Each adapter maps a call onto ``diffusion_ops.minimax_h3_sm120_varlen_attention_nvfp4``
(``precision="nvfp4"``, the default) or ``..._fp8`` (``precision="fp8"``) when, and only when, the
call means exactly what those operators compute: non-causal self-attention, one K/V head per query
head, head dim 128, bf16, no dropout, no window, no bias, no soft-capping, output only. Anything
else raises :class:`UnsupportedOptionError` (a ``ValueError``) naming the argument, before any
kernel runs; a malformed tensor raises the operators' own ``ValueError`` / ``TypeError``. The
adapters never modify their inputs. See ``docs/compat.md``.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import diffusion_ops

__all__ = ["PRECISIONS", "UnsupportedOptionError", "flash_attn_varlen_func", "sageattn"]

PRECISIONS = ("nvfp4", "fp8")


class UnsupportedOptionError(ValueError):
    """An argument asks for something the flashinfer_h3 operators do not compute."""


def _operator(precision: Any) -> Any:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, "
                         f"got {precision!r}")
    # Looked up at call time (tests replace the operator).
    return getattr(diffusion_ops, f"minimax_h3_sm120_varlen_attention_{precision}")


class _Described(str):
    """Shown as is in a message (a tensor's description), not repr'd."""


def _unsupported(fn: str, name: str, value: Any, why: str) -> UnsupportedOptionError:
    shown = value if isinstance(value, _Described) else repr(value)
    return UnsupportedOptionError(f"{fn}: {name}={shown} is not supported: {why}")


def _check_flag(fn: str, name: str, value: Any, why: str) -> None:
    if not isinstance(value, (bool, numbers.Integral)):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__}")
    if value:
        raise _unsupported(fn, name, value, why)


def _tensor(fn: str, name: str, t: Any) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


# ---------------------------------------------------------------------------------------------
# flash_attn_varlen_func
# ---------------------------------------------------------------------------------------------

_FA = "flash_attn_varlen_func"


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
    *,
    precision: str = "nvfp4",
    cu_seqlens_host: Sequence[int] | None = None,
) -> Tensor:
    """flash-attn 2's ``flash_attn_varlen_func`` (same positional order), computed by the NVFP4
    operator (``precision="fp8"``: the FP8 operator).

    ``q, k, v``: bf16 ``[total_tokens, heads, 128]`` (a non-contiguous view, e.g. a slice of a
    packed ``qkv``, is copied to a contiguous tensor; the input is not modified);
    ``cu_seqlens_q``/``cu_seqlens_k``: int32 ``[batch + 1]``, which must describe the same
    segments (pass the same tensor: two different tensors are compared, which synchronises);
    ``max_seqlen_q == max_seqlen_k``. Returns ``out`` ``[total_tokens, heads, 128]`` bf16.

    ``cu_seqlens_host`` (flashinfer_h3 extension): the host copy of the bounds; with it the call
    makes no device-to-host copy (see the operators). ``deterministic`` is accepted (the forward
    pass is deterministic). Raises :class:`UnsupportedOptionError` for ``dropout_p != 0``,
    ``causal=True``, ``window_size != (-1, -1)``, ``softcap != 0``, ``alibi_slopes``,
    ``return_attn_probs=True``, ``block_table``, different query and key bounds or lengths, and a
    different number of K/V heads (GQA/MQA).
    """
    op = _operator(precision)
    q, k, v = (_tensor(_FA, n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    cu_q = _tensor(_FA, "cu_seqlens_q", cu_seqlens_q)
    cu_k = _tensor(_FA, "cu_seqlens_k", cu_seqlens_k)

    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"{_FA}: dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise _unsupported(_FA, "dropout_p", dropout_p, "the operators have no dropout "
                           "(inference only); pass dropout_p=0.0")
    _check_flag(_FA, "causal", causal, "the operators compute full (non-causal) attention")
    if tuple(window_size) != (-1, -1):
        raise _unsupported(_FA, "window_size", window_size,
                           "only full attention, window_size=(-1, -1)")
    if softcap != 0:
        raise _unsupported(_FA, "softcap", softcap, "no logit soft-capping; pass softcap=0.0")
    if alibi_slopes is not None:
        raise _unsupported(_FA, "alibi_slopes", _Described("<tensor>"), "no ALiBi bias; pass None")
    _check_flag(_FA, "return_attn_probs", return_attn_probs,
                "only the output is returned (no softmax_lse or probabilities)")
    if block_table is not None:
        raise _unsupported(_FA, "block_table", _Described("<tensor>"),
                           "no paged KV cache; pass None")
    if not isinstance(deterministic, (bool, numbers.Integral)):
        raise TypeError(f"{_FA}: deterministic must be a bool, "
                        f"got {type(deterministic).__name__}")

    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{_FA}: {name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{_FA}: {name} must be >= 0, got {value}")
    if max_seqlen_q != max_seqlen_k:
        raise _unsupported(_FA, "max_seqlen_k", max_seqlen_k,
                           f"it differs from max_seqlen_q={max_seqlen_q}; the operators compute "
                           "self-attention over equal query and key segments")
    if k.dim() >= 2 and q.dim() >= 2 and k.shape[1] != q.shape[1]:
        raise _unsupported(_FA, "k", _Described(f"<{k.shape[1]} heads>"),
                           f"q has {q.shape[1]} heads; grouped-query / multi-query attention "
                           "(GQA/MQA) is not supported: repeat K and V per query head")
    if k.dim() >= 1 and q.dim() >= 1 and k.shape[0] != q.shape[0]:
        raise _unsupported(_FA, "k", _Described(f"<{k.shape[0]} tokens>"),
                           f"q has {q.shape[0]} tokens; query and key sequences must be the same")
    if cu_k is not cu_q:
        if cu_k.shape != cu_q.shape or cu_k.device != cu_q.device or not torch.equal(cu_k, cu_q):
            raise _unsupported(_FA, "cu_seqlens_k", _Described("<tensor>"),
                               "it differs from cu_seqlens_q; the operators compute "
                               "self-attention over equal query and key segments")
    if cu_seqlens_host is not None:
        bounds = [int(b) for b in cu_seqlens_host]
        longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=False)), default=0)
        if longest > max_seqlen_q:
            raise ValueError(f"{_FA}: max_seqlen_q={max_seqlen_q} is shorter than the longest "
                             f"segment of cu_seqlens_host ({longest})")

    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    return op(q, k, v, cu_q, cu_seqlens_host=cu_seqlens_host, softmax_scale=softmax_scale)


# ---------------------------------------------------------------------------------------------
# sageattn
# ---------------------------------------------------------------------------------------------

_SA = "sageattn"
TENSOR_LAYOUTS = ("HND", "NHD")


@functools.lru_cache(maxsize=64)
def _dense_bounds(batch: int, seqlen: int, device: torch.device) -> tuple[Tensor, tuple[int, ...]]:
    """cu_seqlens of ``batch`` equal segments of ``seqlen`` tokens (device tensor + host copy),
    cached so a repeated shape uploads nothing."""
    host = tuple(i * seqlen for i in range(batch + 1))
    return torch.tensor(host, dtype=torch.int32, device=device), host


def _pack(name: str, t: Tensor, layout: str) -> Tensor:
    """``[B, H, N, D]`` (HND) or ``[B, N, H, D]`` (NHD) -> contiguous ``[B*N, H, D]``: a view
    when the token-major memory allows (NHD contiguous, or HND that is a transposed NHD
    buffer), else a copy (the input is never modified)."""
    if t.dim() != 4:
        dims = "[batch, heads, seq, dim]" if layout == "HND" else "[batch, seq, heads, dim]"
        raise ValueError(f"{_SA}: {name} must be 4-D {dims} for tensor_layout={layout!r}, "
                         f"got shape {list(t.shape)}")
    nhd = t.transpose(1, 2) if layout == "HND" else t
    if not nhd.is_contiguous():
        nhd = nhd.contiguous()
    b, n, h, d = nhd.shape
    return nhd.view(b * n, h, d)


def sageattn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tensor_layout: str = "HND",
    is_causal: bool = False,
    sm_scale: float | None = None,
    return_lse: bool = False,
    *,
    precision: str = "nvfp4",
    **unsupported: Any,
) -> Tensor:
    """SageAttention's ``sageattn`` for a dense batch, computed by the NVFP4 operator
    (``precision="fp8"``: the FP8 operator): the batch is packed into ``batch`` equal segments.

    ``q, k, v``: bf16, ``[batch, heads, seq, 128]`` (``tensor_layout="HND"``) or
    ``[batch, seq, heads, 128]`` (``"NHD"``), all the same shape. No copy is made when the
    memory is token-major (NHD contiguous, or an HND tensor that is ``x.transpose(1, 2)`` of a
    contiguous NHD one, as a DiT's ``view(B, N, H, D).transpose(1, 2)`` gives); otherwise the
    input is copied, never modified. Returns ``out`` in the input's layout (shape); for HND it
    is the ``transpose(1, 2)`` view of a token-major buffer (``.contiguous()`` gives HND memory).

    Raises :class:`UnsupportedOptionError` for ``is_causal=True``, ``return_lse=True``, a
    different query and key length, a different number of K/V heads, and any SageAttention
    tuning keyword (``qk_quant_gran``, ``pv_accum_dtype``, ``smooth_k``, ...): the recipe is
    fixed by ``precision``.
    """
    op = _operator(precision)
    if unsupported:
        names = ", ".join(sorted(unsupported))
        raise UnsupportedOptionError(
            f"{_SA}: unsupported argument(s) {names}: the quantization recipe is fixed by "
            f"precision={precision!r} (SageAttention's tuning options do not apply)")
    if tensor_layout not in TENSOR_LAYOUTS:
        raise ValueError(f"{_SA}: tensor_layout must be 'HND' or 'NHD', got {tensor_layout!r}")
    _check_flag(_SA, "is_causal", is_causal, "the operators compute full (non-causal) attention")
    _check_flag(_SA, "return_lse", return_lse, "only the output is returned (no log-sum-exp)")
    q, k, v = (_tensor(_SA, n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            seq, heads = (2, 1) if tensor_layout == "HND" else (1, 2)
            if t.dim() == 4 and q.dim() == 4 and t.shape[heads] != q.shape[heads]:
                why = (f"q has {q.shape[heads]} heads, {name} {t.shape[heads]}: grouped-query / "
                       "multi-query attention (GQA/MQA) is not supported")
            elif t.dim() == 4 and q.dim() == 4 and t.shape[seq] != q.shape[seq]:
                why = (f"q has {q.shape[seq]} tokens per sequence, {name} {t.shape[seq]}: the "
                       "operators compute self-attention over equal query and key lengths")
            else:
                why = f"expected q's shape {list(q.shape)}"
            raise _unsupported(_SA, name, _Described(f"<shape {list(t.shape)}>"), why)
    pq, pk, pv = (_pack(n, t, tensor_layout) for n, t in (("q", q), ("k", k), ("v", v)))
    batch, seqlen = (q.shape[0], q.shape[2]) if tensor_layout == "HND" else q.shape[:2]
    cu_seqlens, host = _dense_bounds(int(batch), int(seqlen), q.device)
    out = op(pq, pk, pv, cu_seqlens, cu_seqlens_host=host, softmax_scale=sm_scale)
    out = out.view(batch, seqlen, *out.shape[1:])
    return out.transpose(1, 2) if tensor_layout == "HND" else out
