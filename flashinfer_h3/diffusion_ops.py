"""Public operators: low-precision packed-varlen attention for MiniMax-H3 (SPEC 2).

One call, in order (``_varlen_attention``)::

    check scalars, tensors, devices          nothing launched yet; ``out`` untouched on error
    bounds = cu_seqlens_host or cu_seqlens   a D2H copy only without cu_seqlens_host
    check bounds (on a plan-cache miss)      cu_seqlens[0] == 0, non-decreasing, [-1] == tokens
    backend = backends.prepared(op, device)  RuntimeError: GPU, toolchain, capture
    plan  = PLANS.get(bounds, heads, device)          plan.py (LRU; under capture: built on device)
    views = workspace of (device, stream)             workspace.py (grow-only; under capture: temp)
    backend.launch(...)                               kernels on torch's current stream

Backends (``backends.py``): which kernel (or the torch reference) runs each operator on this GPU,
chosen by ``flashinfer_h3.use_backend`` / ``set_backend`` or ``FLASHINFER_H3_NVFP4_BACKEND`` /
``FLASHINFER_H3_FP8_BACKEND`` (default ``auto``). The ``reference`` backend runs the torch
emulation (``reference.py``) on the GPU: the exact recipe, slow, not sync-free and not
capturable into a CUDA graph; the FP8 operator runs on it until an FP8 kernel is registered.

torch integration. Each operator is also a custom op (``torch.ops.flashinfer_h3.*``) with a
fake implementation, used only while ``torch.compile`` traces (``torch.compiler.is_compiling()``),
so eager calls skip the dispatcher. In compiled code ``cu_seqlens_host`` travels as an ``int[]``
(a list or tuple of Python ints; a tensor is not accepted there).
"""

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import backends
from .constants import HEAD_DIM
from .plan import PLANS, Plan, captured_plan
from .workspace import captured_views, eager_views, layout_for

__all__ = [
    "DEFAULT_SOFTMAX_SCALE",
    "minimax_h3_sm120_varlen_attention_fp8",
    "minimax_h3_sm120_varlen_attention_nvfp4",
    "varlen_attention_fp8",
    "varlen_attention_nvfp4",
    "workspace_bytes_fp8",
    "workspace_bytes_nvfp4",
]

DEFAULT_SOFTMAX_SCALE = 1.0 / math.sqrt(HEAD_DIM)
ENV_NVFP4_BACKEND = backends.ENV_BACKEND["nvfp4"]
ENV_FP8_BACKEND = backends.ENV_BACKEND["fp8"]
_INT32_MAX = 2**31 - 1
_BF16 = torch.bfloat16
_I32 = torch.int32


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def workspace_bytes_nvfp4(tokens: int, num_heads: int, num_segments: int, *,
                          backend: str | None = None) -> int:
    """Exact workspace size, in bytes, of an NVFP4 call with these counts on ``backend`` (a
    backend name; default: the one a call would use now on the current CUDA device; without a
    GPU, the NVFP4 operands' layout). The Hopper kernel's layout adds the FP16 operands."""
    return _workspace_bytes("nvfp4", tokens, num_heads, num_segments, backend)


def workspace_bytes_fp8(tokens: int, num_heads: int, num_segments: int, *,
                        backend: str | None = None) -> int:
    """Exact workspace size, in bytes, of an FP8 call with these counts (``backend`` as for
    :func:`workspace_bytes_nvfp4`)."""
    return _workspace_bytes("fp8", tokens, num_heads, num_segments, backend)


def _workspace_bytes(op: str, tokens: int, heads: int, segments: int,
                     backend: str | None) -> int:
    layout = op  # the operator's own layout: what every kernel backend reads at least
    if backend is not None and backend.strip().lower() == backends.AUTO:
        backend = None
    if backend is not None:
        layout = backends.get(op, backend).workspace or ""
    elif torch.cuda.is_available():
        choice, source = backends.current_choice(op)
        try:
            chosen = backends.resolve(op, torch.cuda.get_device_capability(), choice,
                                      source=source)
            layout = chosen.workspace or ""
        except RuntimeError:  # no backend here (a call would raise): the operator's layout
            pass
    size = layout_for(op, tokens, heads, segments).total_bytes  # checks the counts
    return size if layout == op else (layout_for(layout, tokens, heads, segments).total_bytes
                                      if layout else 0)


def minimax_h3_sm120_varlen_attention_nvfp4(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, out: Tensor | None = None, *,
    cu_seqlens_host: Sequence[int] | None = None, softmax_scale: float | None = None,
) -> Tensor:
    """NVFP4 (SageAttention3 recipe) non-causal packed-varlen self-attention.

    For every segment ``[a, b)`` of ``cu_seqlens`` and head ``h``:
    ``out[a:b, h] = softmax(q[a:b, h] @ k[a:b, h]^T * softmax_scale) @ v[a:b, h]``, computed
    with the NVFP4 recipe of SPEC 3 (block-scaled E2M1 operands, FP32 softmax, one BF16
    rounding).

    Args:
        q, k, v: contiguous ``torch.bfloat16`` CUDA tensors ``[tokens, heads, 128]``.
        cu_seqlens: ``torch.int32`` ``[segments + 1]`` on the same device; starts at 0,
            non-decreasing, ends at ``tokens``. Empty segments are allowed.
        out: optional contiguous bf16 ``[tokens, heads, 128]`` output, written in place.
        cu_seqlens_host: optional host copy of ``cu_seqlens`` (list/tuple of ints or a CPU
            tensor). With it the call makes no device-to-host copy and no synchronisation; it
            must equal ``cu_seqlens`` (not re-checked on the device). Required during CUDA
            graph capture.
        softmax_scale: finite float > 0; default ``1 / sqrt(128)``.

    Returns:
        ``out`` (allocated when not given).

    Raises:
        TypeError / ValueError: a malformed argument (named in the message); nothing launched.
        RuntimeError: a GPU without kernels, no toolchain, or a reference backend under capture.
    """
    if torch.compiler.is_compiling():
        return _compiled_call("nvfp4", q, k, v, cu_seqlens, out, cu_seqlens_host, softmax_scale)
    return _varlen_attention("nvfp4", q, k, v, cu_seqlens, out, cu_seqlens_host, softmax_scale)


def minimax_h3_sm120_varlen_attention_fp8(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, out: Tensor | None = None, *,
    cu_seqlens_host: Sequence[int] | None = None, softmax_scale: float | None = None,
) -> Tensor:
    """FP8 (E4M3) non-causal packed-varlen self-attention (SPEC 4); same contract as
    :func:`minimax_h3_sm120_varlen_attention_nvfp4`.

    Runs on the torch emulation of the recipe where no FP8 kernel backend is registered for the
    GPU (slow; it synchronises and cannot be captured into a CUDA graph): see
    ``python -m flashinfer_h3 info``.
    """
    if torch.compiler.is_compiling():
        return _compiled_call("fp8", q, k, v, cu_seqlens, out, cu_seqlens_host, softmax_scale)
    return _varlen_attention("fp8", q, k, v, cu_seqlens, out, cu_seqlens_host, softmax_scale)


#: Arch-neutral names of the two operators (the same functions).
varlen_attention_nvfp4 = minimax_h3_sm120_varlen_attention_nvfp4
varlen_attention_fp8 = minimax_h3_sm120_varlen_attention_fp8


# ---------------------------------------------------------------------------------------------
# One call
# ---------------------------------------------------------------------------------------------


def _varlen_attention(op: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                      out: Tensor | None, cu_seqlens_host: Any,
                      softmax_scale: float | None) -> Tensor:
    scale = check_softmax_scale(softmax_scale)
    tokens, heads = check_tensors(q, k, v, cu_seqlens, out)
    device = q.device
    stream, capturing = _stream_state(device)
    bounds, plan = _bounds_and_plan(cu_seqlens, cu_seqlens_host, tokens, heads, device, capturing)
    check_cuda(q)  # last, so that CPU tensors reach every check above
    backend = _backend(op, device)  # RuntimeError before any launch: GPU, toolchain
    if capturing and not backend.capturable:
        raise RuntimeError(_not_capturable(op, backend))
    if out is None:
        out = torch.empty_like(q)
    if tokens == 0:
        return out
    workspace = backend.workspace
    if workspace is None:  # the reference: host bounds only
        backend.launch(q, k, v, out, scale, bounds, None, ())
        return out
    layout = layout_for(workspace, tokens, heads, len(bounds) - 1)
    if capturing:  # tables (built from cu_seqlens) and workspace: temporaries
        plan, views = captured_plan(bounds, heads, cu_seqlens), captured_views(layout, device)
    else:
        plan = plan if plan is not None else PLANS.get(bounds, heads, device)
        plan.ready(stream)
        views = eager_views(layout, device, stream)
    backend.launch(q, k, v, out, scale, bounds, plan, views)
    return out


# ---------------------------------------------------------------------------------------------
# Argument checks (every one before any launch; none reads device memory except the one D2H
# copy of cu_seqlens when cu_seqlens_host is absent)
# ---------------------------------------------------------------------------------------------


def check_softmax_scale(softmax_scale: Any) -> float:
    """The scale to use: ``1/sqrt(128)`` for ``None``; else a finite real > 0."""
    if softmax_scale is None:
        return DEFAULT_SOFTMAX_SCALE
    if type(softmax_scale) is not float and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
    ):
        raise TypeError(
            f"softmax_scale must be a float (or None for 1/sqrt(128)), got "
            f"{type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return scale


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _well_formed(q: Any, k: Any, v: Any, cu_seqlens: Any, out: Any) -> bool:
    """The common case of :func:`check_tensors` in few attribute reads: plain tensors, bf16
    ``[T, H, 128]`` alike, contiguous, int32 1-D ``cu_seqlens``, one device, an ``out`` that
    does not overlap the inputs. False sends the call through the full checks (and their
    messages); True means they would all pass."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and type(cu_seqlens) is Tensor and (out is None or type(out) is Tensor)):
        return False
    shape = q.shape
    if (len(shape) != 3 or shape[2] != HEAD_DIM or shape[1] < 1 or shape[0] > _INT32_MAX
            or k.shape != shape or v.shape != shape or q.dtype != _BF16 or k.dtype != _BF16
            or v.dtype != _BF16 or not (q.is_contiguous() and k.is_contiguous()
                                        and v.is_contiguous())
            or cu_seqlens.dtype != _I32 or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1):
        return False
    # get_device() is the CUDA index (-1 on the CPU): with q on CUDA, equal indices mean one GPU.
    dev = q.get_device()
    if (not q.is_cuda or k.get_device() != dev or v.get_device() != dev
            or cu_seqlens.get_device() != dev):
        return False
    if out is None:
        return True
    if (out.shape != shape or out.dtype != _BF16 or not out.is_contiguous()
            or out.get_device() != dev):
        return False
    lo = out.data_ptr()
    hi = lo + out.nbytes
    size = out.nbytes  # == q.nbytes == k.nbytes == v.nbytes
    return all(not (p < hi and lo < p + size) for p in (q.data_ptr(), k.data_ptr(), v.data_ptr()))


def check_tensors(q: Any, k: Any, v: Any, cu_seqlens: Any, out: Any, *,
                  check_overlap: bool = True) -> tuple[int, int]:
    """Types, dtypes, shapes, contiguity and devices (all relative to ``q``), and that ``out``
    does not overlap an input; returns ``(tokens, heads)``. Reads no tensor contents; pass
    ``check_overlap=False`` for fake tensors (they have no addresses)."""
    if check_overlap and _well_formed(q, k, v, cu_seqlens, out):
        return q.shape[0], q.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != _BF16:
            raise ValueError(f"{name} must be torch.bfloat16, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [tokens, heads, {HEAD_DIM}], got shape {_shape(t)}"
            )
        if t.shape[2] != HEAD_DIM:
            raise ValueError(
                f"{name} must have head dim {HEAD_DIM} (shape [tokens, heads, {HEAD_DIM}]), got "
                f"shape {_shape(t)}"
            )
    tokens, heads = q.shape[0], q.shape[1]
    if heads < 1:
        raise ValueError(f"q must have heads >= 1, got shape {_shape(q)}")
    if tokens > _INT32_MAX:
        raise ValueError(f"q has {tokens} tokens; at most {_INT32_MAX} (int32 cu_seqlens)")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name} has shape {_shape(t)}, expected q's shape {_shape(q)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (packed [tokens, heads, {HEAD_DIM}])")
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(
            f"cu_seqlens must be a torch.int32 tensor, got {type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dtype != _I32:
        raise ValueError(f"cu_seqlens must be torch.int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D [segments + 1] with at least one entry, got shape "
            f"{_shape(cu_seqlens)}"
        )
    if out is not None:
        if not isinstance(out, Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.dtype != _BF16:
            raise ValueError(f"out must be torch.bfloat16, got {out.dtype}")
        if out.shape != q.shape:
            raise ValueError(f"out has shape {_shape(out)}, expected q's shape {_shape(q)}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    dev = q.device
    for name, t in (("k", k), ("v", v), ("cu_seqlens", cu_seqlens), ("out", out)):
        if t is not None and t.device != dev:
            raise ValueError(f"{name} is on {t.device}, expected q's device {dev}")
    if check_overlap and out is not None and out.numel() and dev.type != "meta":
        lo, hi = out.data_ptr(), out.data_ptr() + out.nbytes
        for name, t in (("q", q), ("k", k), ("v", v)):
            p = t.data_ptr()
            if p < hi and lo < p + t.nbytes:
                raise ValueError(f"out must not overlap {name} (inputs are never modified)")
    return tokens, heads


def check_cuda(q: Tensor) -> None:
    """The operators run on CUDA tensors (checked last: see ``_varlen_attention``)."""
    if q.device.type != "cuda":
        raise ValueError(
            f"q, k, v, cu_seqlens (and out) must be CUDA tensors, got q on {q.device}"
        )


def _as_host_tuple(cu_seqlens_host: Any) -> tuple:
    """``cu_seqlens_host`` as a tuple, without touching the device."""
    h = cu_seqlens_host
    if type(h) is tuple:
        return h
    if type(h) is list:
        return tuple(h)
    if isinstance(h, Tensor):
        if h.device.type != "cpu":
            raise TypeError(
                f"cu_seqlens_host must live on the host (a sequence of ints or a CPU tensor), "
                f"got a tensor on {h.device}: reading it would synchronise; pass "
                "cu_seqlens_host=None to let the call copy cu_seqlens once"
            )
        if h.dim() != 1 or h.dtype.is_floating_point or h.dtype.is_complex or h.dtype == torch.bool:
            raise TypeError(
                f"cu_seqlens_host as a tensor must be a 1-D integer CPU tensor, got {h.dtype} "
                f"with shape {_shape(h)}"
            )
        return tuple(h.tolist())
    if isinstance(h, (str, bytes, bytearray, dict, set, frozenset)) or not (
        hasattr(h, "__len__") and hasattr(h, "__iter__")
    ):
        raise TypeError(
            f"cu_seqlens_host must be a sequence of ints (list, tuple) or None, got "
            f"{type(h).__name__}"
        )
    return tuple(h.tolist()) if hasattr(h, "tolist") else tuple(h)  # numpy arrays -> ints


def check_bounds(bounds: Sequence[Any], tokens: int, name: str) -> tuple[int, ...]:
    """Validated ``cu_seqlens`` values as a tuple of ints (``name`` is used in messages)."""
    ints = []
    for i, b in enumerate(bounds):
        if isinstance(b, bool):
            raise TypeError(f"{name}[{i}] must be an int, got bool")
        try:
            ints.append(operator.index(b))
        except TypeError:
            raise TypeError(f"{name}[{i}] must be an int, got {type(b).__name__}") from None
    if not ints:
        raise ValueError(f"{name} must have at least one entry (cu_seqlens[0] == 0)")
    if ints[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {ints[0]}")
    for i in range(1, len(ints)):
        if ints[i] < ints[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i - 1}] = {ints[i - 1]} > "
                f"{name}[{i}] = {ints[i]}"
            )
    if ints[-1] != tokens:
        raise ValueError(
            f"{name}[-1] must equal tokens = q.shape[0] = {tokens}, got {ints[-1]}"
        )
    return tuple(ints)


def _bounds_and_plan(cu_seqlens: Tensor, cu_seqlens_host: Any, tokens: int, heads: int,
                     device: torch.device, capturing: bool) -> tuple[tuple[int, ...], Plan | None]:
    """The host bounds of the call and its cached eager plan (``None`` on a miss).

    A plan-cache hit with plain ints means these exact bounds were validated before, so only
    the per-call facts (entry count, last entry == tokens) are checked again.
    """
    if cu_seqlens_host is None:
        if capturing:
            raise ValueError(
                "cu_seqlens_host is required while a CUDA graph is being captured (reading "
                "cu_seqlens on the host would synchronise); pass cu_seqlens_host=<list of ints>"
            )
        name, bounds = "cu_seqlens", tuple(cu_seqlens.tolist())  # the one D2H copy
    else:
        name, bounds = "cu_seqlens_host", _as_host_tuple(cu_seqlens_host)
        if len(bounds) != cu_seqlens.shape[0]:
            raise ValueError(
                f"cu_seqlens_host has {len(bounds)} entries, expected {cu_seqlens.shape[0]} "
                "(the length of cu_seqlens)"
            )
    plan = PLANS.lookup(bounds, heads, device)
    if plan is None or bounds[-1] != tokens or not all(type(b) is int for b in bounds):
        return check_bounds(bounds, tokens, name), plan  # full check (and canonical ints)
    return bounds, plan


def _stream_state(device: torch.device) -> tuple[int, bool]:
    """``(raw handle of torch's current stream on device, is it capturing a CUDA graph)``."""
    if device.type != "cuda":
        return 0, False
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    if device.index == torch._C._cuda_getDevice():
        return stream, torch._C._cuda_isCurrentStreamCapturing()
    with torch.cuda.device(device):
        return stream, torch._C._cuda_isCurrentStreamCapturing()


# ---------------------------------------------------------------------------------------------
# Backends (backends.py holds the registry; these names stay for callers of earlier releases)
# ---------------------------------------------------------------------------------------------

#: ``_backend(op, device)``: the prepared backend of a call (a seam the tests replace).
_backend = backends.prepared


def _not_capturable(op: str, backend: backends.Prepared) -> str:
    env = backends.ENV_BACKEND[op]
    return (
        f"the {op} operator runs on {backend.backend.label} here, which cannot be captured into "
        f"a CUDA graph (the torch emulation copies host data synchronously); choose a kernel "
        f"backend ({env}, flashinfer_h3.set_backend) where one runs on this GPU, or call it "
        "outside the capture"
    )


def resolve_backend_name(op: str, capability: tuple[int, int], choice: str) -> str:
    """The name of the backend of ``op`` on a GPU of ``capability`` for ``choice`` (pure logic;
    see :func:`flashinfer_h3.backends.resolve`)."""
    return backends.resolve(op, capability, choice).name


def reset_backends() -> None:
    """Forget the prepared backends (the choice itself is read on every call)."""
    backends.reset()


# ---------------------------------------------------------------------------------------------
# torch custom ops (used while torch.compile traces; eager calls bypass the dispatcher)
# ---------------------------------------------------------------------------------------------


def _register_custom_ops(op: str) -> tuple[Any, Any]:
    @torch.library.custom_op(f"flashinfer_h3::varlen_attention_{op}", mutates_args=())
    def functional(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                   cu_seqlens_host: list[int] | None, softmax_scale: float | None) -> Tensor:
        return _varlen_attention(op, q, k, v, cu_seqlens, None, cu_seqlens_host, softmax_scale)

    @functional.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
          cu_seqlens_host: list[int] | None, softmax_scale: float | None) -> Tensor:
        check_softmax_scale(softmax_scale)
        check_tensors(q, k, v, cu_seqlens, None, check_overlap=False)
        return torch.empty_like(q)

    @torch.library.custom_op(f"flashinfer_h3::varlen_attention_{op}_out", mutates_args=("out",))
    def with_out(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, out: Tensor,
                 cu_seqlens_host: list[int] | None, softmax_scale: float | None) -> None:
        _varlen_attention(op, q, k, v, cu_seqlens, out, cu_seqlens_host, softmax_scale)

    @with_out.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, out: Tensor,
          cu_seqlens_host: list[int] | None, softmax_scale: float | None) -> None:
        check_softmax_scale(softmax_scale)
        check_tensors(q, k, v, cu_seqlens, out, check_overlap=False)

    return functional, with_out


_CUSTOM_OPS = {op: _register_custom_ops(op) for op in ("nvfp4", "fp8")}


def _compiled_call(op: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
                   out: Tensor | None, cu_seqlens_host: Any, softmax_scale: Any) -> Tensor:
    """The traced form of a call: the custom op (functional, or ``_out`` when ``out`` is
    given)."""
    host = None if cu_seqlens_host is None else [int(b) for b in cu_seqlens_host]
    functional, with_out = _CUSTOM_OPS[op]
    if out is None:
        return functional(q, k, v, cu_seqlens, host, softmax_scale)
    with_out(q, k, v, cu_seqlens, out, host, softmax_scale)
    return out
