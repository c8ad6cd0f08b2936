"""Reference numerics: the FP32 oracle and an exact torch emulation of both recipes (SPEC 3, 4).

Everything runs on CPU or CUDA (the device of ``q``), per segment, vectorised over heads, with
queries in chunks and keys in 128-key tiles counted from the segment start, so nothing of size
``[L, L, H]`` is ever materialised.

Entry points
------------
- ``attention_oracle``: exact softmax attention per segment (FP64 inside, FP32 result).
- ``varlen_attention_nvfp4_reference`` / ``varlen_attention_fp8_reference``: the recipes,
  ``= *_attention_from_stages(*_quantize_stages(...))``.
- ``nvfp4_means``, ``nvfp4_quantize_stages``, ``fp8_quantize_stages``: the quantized operands in
  the exact layout the kernels write into the workspace (``flashinfer_h3/layout.py``), with the
  real counts of the call instead of the layout's caps:

  ===========  =====  ==================  ====================================================
  stage        dtype  shape               contents (S segments, NQB = plan blocks,
                                          NV = ``vkey_start[S]`` padded V columns)
  ===========  =====  ==================  ====================================================
  **nvfp4**
  kbar         f32    [S, H, 128]         per-segment mean of k (0 for an empty segment)
  qbar         f32    [NQB, H, 128]       per-128-row-block mean of q, canonical block order
  q_codes      u8     [H, T, 64]          E2M1 of ``q - qbar``, channel 2c low nibble
  q_scales     u8     [H, T, 8]           UE4M3 scale of channels 16j..16j+15
  k_codes      u8     [H, T, 64]          E2M1 of ``k - kbar``
  k_scales     u8     [H, T, 8]
  v_codes      u8     [H, 128, NV / 2]    V transposed (row = channel, column = padded key)
  v_scales     u8     [H, 128, NV / 16]   scale of padded keys 16t..16t+15
  **fp8**
  kbar         f32    [S, H, 128]         as above
  q_codes      u8     [H, T, 128]         E4M3 of q (no smoothing)
  q_scales     f32    [H, T]              amax / 448 per (head, token)
  k_codes      u8     [H, T, 128]         E4M3 of ``k - kbar``
  k_scales     f32    [H, NQB]            amax / 448 per (head, 128-key block), canonical order
  v_codes      u8     [H, 128, NV]        V transposed, padded as for nvfp4, keys permuted
                                          within each 16-key group (``fp8_v_column``)
  v_scales     f32    [S, H, 128]         amax / 448 per (segment, head, channel)
  ===========  =====  ==================  ====================================================

  Padded V columns (past a segment's last key, up to its multiple of 64) hold code 0, scale 0.
  An FP8 scale below 2^-126 is 0 with its codes (SPEC 4.1, ``formats.fp8_scale``).

- ``nvfp4_fp16_operands``: the same NVFP4 operands as the Hopper kernel reads them (layout
  ``nvfp4_fp16``, backend ``wgmma_fp16_nvfp4``), each value ``s * code`` exactly, as FP16:

  ===========  =====  ==================  ====================================================
  q_f16        f16    [H, T, 128]         Q' values, token order
  k_f16        f16    [H, NV, 128]        K' values at padded positions in the window order
                                          (``layout.window_key_at``), zeros past a segment's
                                          last key
  v_f16        f16    [H, 128, NV]        V^T values at the same positions (the padding's
                                          values are 0: code 0, scale 0)
  ===========  =====  ==================  ====================================================

  ``trim_stages`` cuts the layout's workspace views down to these shapes, so a kernel's
  workspace compares bit for bit with ``torch.equal``. The ``*_attention_from_stages`` functions
  also accept the uncut views (extra qbar rows / V columns are ignored).

Rounding conventions (the parts SPEC leaves to the implementation)
------------------------------------------------------------------
- ``+ - *`` are single FP32 operations (one IEEE rounding; separate torch ops, never fused);
  quotients and ``exp2`` are evaluated in FP64 and rounded once to FP32 (for a quotient that is
  the correctly rounded FP32 result; ``exp2`` is then correctly rounded up to FP64's error);
  dot products (scores, delta, P.V, means) are FP64 sums rounded once to FP32 (exact for
  realistic NVFP4/FP8 operands, so independent of summation order and of the device).
- ``c = fp32(fp32(softmax_scale) * fp32(log2 e))``; the scores stay in raw units.
- Means: FP64 sum over the rows, divided by the row count, rounded to FP32.
- NVFP4 scores: ``S = fp32(Qhat . Khat + delta)``, ``delta = fp32(qbar . Khat)``.
  FP8 scores: ``S = fp32(fp32(sq * sk) * fp32(qcode . kcode))``.
- Per tile: ``alpha = fp32(exp2(fp32(fp32(m_prev - m) * c)))``,
  ``Ptil = fp32(P0 * fp32(exp2(fp32(fp32(S - m) * c))))`` with ``P0 = 2688`` (NVFP4) or 256
  (FP8), ``l = fp32(fp32(alpha * l) + fp32(sum Ptil))``,
  ``O = fp32(fp32(alpha * O) + fp32(Phat . Vhat))``.
- Output: NVFP4 ``bf16(fp32(O / l))``; FP8 ``bf16(fp32(fp32(O * sv) / l))``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch

from . import formats as F
from .layout import GROUP, HEAD_DIM, Q_BLOCK, V_KEY_PAD, window_key_at
from .plan import HostPlan, build_host_plan

LOG2E = math.log2(math.e)
NVFP4_P_SCALE = 2688.0  # 448 * 6: the row max lands on the largest UE4M3 scale times E2M1 6
FP8_P_SCALE = 256.0
KV_TILE = 128  # keys per tile of the online softmax, counted from the segment start
_TILE_ELEMENTS = 1 << 23  # query chunk: heads * rows * KV_TILE scores at most (FP64: 64 MiB)
_ORACLE_ELEMENTS = 1 << 25  # oracle chunk: heads * rows * L scores at most (FP64: 256 MiB)

__all__ = [
    "attention_oracle",
    "fp8_attention_from_stages",
    "fp8_quantize_stages",
    "log2_softmax_scale",
    "nvfp4_attention_from_stages",
    "nvfp4_fp16_operands",
    "nvfp4_means",
    "nvfp4_quantize_stages",
    "trim_stages",
    "varlen_attention_fp8_reference",
    "varlen_attention_nvfp4_reference",
    "window_order",
]

CuSeqlens = torch.Tensor | Sequence[int]


# ---------------------------------------------------------------------------------------------
# Argument handling
# ---------------------------------------------------------------------------------------------


def _check_qkv(**tensors: torch.Tensor) -> tuple[int, int, torch.device]:
    first = None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be torch.bfloat16, got {t.dtype}")
        if t.dim() != 3 or t.shape[2] != HEAD_DIM or t.shape[1] < 1:
            raise ValueError(
                f"{name} must have shape [tokens, heads >= 1, {HEAD_DIM}], got {tuple(t.shape)}"
            )
        if first is None:
            first = (name, t)
        elif t.shape != first[1].shape or t.device != first[1].device:
            raise ValueError(
                f"{name} {tuple(t.shape)} on {t.device} does not match {first[0]} "
                f"{tuple(first[1].shape)} on {first[1].device}"
            )
    assert first is not None
    t = first[1]
    return t.shape[0], t.shape[1], t.device


def _host_bounds(cu_seqlens: CuSeqlens, tokens: int,
                 cu_seqlens_host: Sequence[int] | None = None) -> tuple[int, ...]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
            raise ValueError(
                f"cu_seqlens must be a 1-D torch.int32 tensor, got {cu_seqlens.dtype} with shape "
                f"{tuple(cu_seqlens.shape)}"
            )
        bounds = tuple(cu_seqlens.tolist())
    elif isinstance(cu_seqlens, Sequence) and not isinstance(cu_seqlens, str):
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in cu_seqlens):
            raise TypeError("cu_seqlens must be an int32 tensor or a sequence of ints")
        bounds = tuple(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if not bounds or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start with 0, got {list(bounds[:4])}")
    if any(b < a for a, b in zip(bounds[:-1], bounds[1:], strict=True)):
        raise ValueError("cu_seqlens must be non-decreasing")
    if bounds[-1] != tokens:
        raise ValueError(f"cu_seqlens[-1] must equal the number of tokens {tokens}, "
                         f"got {bounds[-1]}")
    if cu_seqlens_host is not None and tuple(int(b) for b in cu_seqlens_host) != bounds:
        raise ValueError("cu_seqlens_host does not match cu_seqlens")
    return bounds


def _softmax_scale(softmax_scale: float | None) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(HEAD_DIM)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
    return scale


def log2_softmax_scale(softmax_scale: float | None = None) -> float:
    """``c = fp32(fp32(softmax_scale) * fp32(log2 e))``, the exponent factor of both recipes."""
    scale = torch.tensor(_softmax_scale(softmax_scale), dtype=torch.float32)
    return float(F.mul_rn(scale, torch.tensor(LOG2E, dtype=torch.float32)))


def _plan(cu_seqlens: CuSeqlens, tokens: int,
          cu_seqlens_host: Sequence[int] | None) -> HostPlan:
    return build_host_plan(_host_bounds(cu_seqlens, tokens, cu_seqlens_host))


def _segments(plan: HostPlan):
    """``(s, a, b)`` of every non-empty segment."""
    b = plan.bounds
    return [(s, b[s], b[s + 1]) for s in range(plan.num_segments) if b[s + 1] > b[s]]


def _token_maps(plan: HostPlan, device: torch.device):
    """Per token: its segment, its canonical 128-row block and its padded V column (int64)."""
    bounds = torch.tensor(plan.bounds, dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(plan.num_segments), bounds.diff())
    pos = torch.arange(plan.tokens) - bounds[seg]
    block = torch.tensor(plan.qblock_start, dtype=torch.int64)[seg] + pos // Q_BLOCK
    vcol = torch.tensor(plan.vkey_start, dtype=torch.int64)[seg] + pos
    return seg.to(device), block.to(device), vcol.to(device)


def fp8_v_column(pos: torch.Tensor) -> torch.Tensor:
    """The FP8 V column offset (from the segment's first padded column) of key ``pos``.

    Within each 16-key group (counted from the segment start) key ``r = 8h + 2q + e`` (``h, e``
    in {0, 1}, ``q`` in 0..3) sits at column ``4q + 2h + e``. That is the order in which a thread
    of an FP8 MMA holds P after its QK^T: the m16n8 (and wgmma m64nN) FP32 accumulator gives a
    thread keys ``2q, 2q+1`` of each 8-key chunk, while the E4M3 A operand of the PV product
    wants four consecutive keys ``4q..4q+3`` per register. With V's keys in this order the
    accumulator packs straight into the A operand (no shuffles); P.V sums over keys, so the
    product is unchanged.
    """
    r = pos % GROUP
    return pos - r + 4 * ((r % 8) // 2) + 2 * (r // 8) + r % 2


def fp8_v_key_order(columns: int, device: torch.device | None = None) -> torch.Tensor:
    """``key[j]`` = the key (offset from the segment start) stored at V column ``j``, for
    ``columns`` (a multiple of 16) columns: the inverse of :func:`fp8_v_column`."""
    cols = torch.arange(columns, device=device)
    order = torch.empty_like(cols)
    order[fp8_v_column(cols)] = cols
    return order


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                  device: torch.device, at_least: tuple[bool, ...] | None = None) -> None:
    """dtype, device and shape of a given operand; ``at_least[i]``: dimension i may be larger."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    at_least = at_least or (False,) * len(shape)
    dims = list(zip(shape, at_least, strict=True))
    ok = t.dim() == len(shape) and all(
        (d >= want) if more else (d == want) for d, (want, more) in zip(t.shape, dims, strict=True)
    )
    if t.dtype != dtype or not ok or t.device != device:
        want = ", ".join(f">={d}" if more else str(d) for d, more in dims)
        raise ValueError(
            f"{name} must be {dtype} [{want}] on {device}, got {t.dtype} {tuple(t.shape)} "
            f"on {t.device}"
        )


# ---------------------------------------------------------------------------------------------
# Means and quantized operands
# ---------------------------------------------------------------------------------------------


def _segment_means(k: torch.Tensor, plan: HostPlan) -> torch.Tensor:
    kbar = torch.zeros(plan.num_segments, k.shape[1], HEAD_DIM, dtype=torch.float32,
                       device=k.device)
    for s, a, b in _segments(plan):
        kbar[s] = (k[a:b].double().sum(0) / (b - a)).float()
    return kbar


def _block_means(q: torch.Tensor, plan: HostPlan) -> torch.Tensor:
    H = q.shape[1]
    qbar = torch.empty(plan.num_qblocks, H, HEAD_DIM, dtype=torch.float32, device=q.device)
    for s, a, b in _segments(plan):
        L = b - a
        nblk = -(-L // Q_BLOCK)
        rows = torch.zeros(nblk * Q_BLOCK, H, HEAD_DIM, dtype=torch.float64, device=q.device)
        rows[:L] = q[a:b].double()
        counts = torch.tensor([min(Q_BLOCK, L - g * Q_BLOCK) for g in range(nblk)],
                              dtype=torch.float64, device=q.device)
        sums = rows.view(nblk, Q_BLOCK, H, HEAD_DIM).sum(1)
        g0 = plan.qblock_start[s]
        qbar[g0 : g0 + nblk] = (sums / counts[:, None, None]).float()
    return qbar


def nvfp4_means(q: torch.Tensor, k: torch.Tensor, cu_seqlens: CuSeqlens, *,
                cu_seqlens_host: Sequence[int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kbar [S, H, 128], qbar [NQB, H, 128])``, FP32, canonical block order (SPEC 3.1-3.2)."""
    T, _, _ = _check_qkv(q=q, k=k)
    plan = _plan(cu_seqlens, T, cu_seqlens_host)
    return _segment_means(k, plan), _block_means(q, plan)


def _transpose_v(values: torch.Tensor, vcol: torch.Tensor, columns: int) -> torch.Tensor:
    """``[T, H, 128]`` per-token values -> ``[H, 128, columns]`` at their padded V columns (the
    other columns 0)."""
    T, H, D = values.shape
    out = torch.zeros(H, D, columns, dtype=values.dtype, device=values.device)
    return out.index_copy_(2, vcol, values.permute(1, 2, 0))


def _subtract(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``fp32(x - mean)`` as ``[H, T, 128]`` (x bf16 ``[T, H, 128]``, mean FP32 per token)."""
    return (x.double() - mean.double()).float().transpose(0, 1).contiguous()


def nvfp4_quantize_stages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens: CuSeqlens, kbar: torch.Tensor | None = None,
                          qbar: torch.Tensor | None = None, *,
                          cu_seqlens_host: Sequence[int] | None = None
                          ) -> dict[str, torch.Tensor]:
    """The NVFP4 quantized operands (SPEC 3.1-3.3) in the workspace layout (module doc table).

    Given ``kbar`` / ``qbar`` (e.g. a kernel's) are used as they are, so a kernel's codes and
    scales can be compared bit for bit; ``qbar`` may have more rows than the plan's blocks.
    """
    T, H, device = _check_qkv(q=q, k=k, v=v)
    plan = _plan(cu_seqlens, T, cu_seqlens_host)
    S, nqb, nv = plan.num_segments, plan.num_qblocks, plan.vkey_start[-1]
    if kbar is None:
        kbar = _segment_means(k, plan)
    _check_tensor(kbar, "kbar", torch.float32, (S, H, HEAD_DIM), device)
    if qbar is None:
        qbar = _block_means(q, plan)
    _check_tensor(qbar, "qbar", torch.float32, (nqb, H, HEAD_DIM), device, (True, False, False))
    qbar = qbar[:nqb]
    seg, block, vcol = _token_maps(plan, device)
    q_codes, q_scales = F.nvfp4_quantize(_subtract(q, qbar[block]))
    k_codes, k_scales = F.nvfp4_quantize(_subtract(k, kbar[seg]))
    v_codes, v_scales = F.nvfp4_quantize(_transpose_v(v.float(), vcol, nv))
    return {"kbar": kbar, "qbar": qbar, "q_codes": q_codes, "q_scales": q_scales,
            "k_codes": k_codes, "k_scales": k_scales, "v_codes": v_codes, "v_scales": v_scales}


def fp8_quantize_stages(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens: CuSeqlens, kbar: torch.Tensor | None = None, *,
                        cu_seqlens_host: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The FP8 quantized operands (SPEC 4.1) in the workspace layout (module doc table)."""
    T, H, device = _check_qkv(q=q, k=k, v=v)
    plan = _plan(cu_seqlens, T, cu_seqlens_host)
    S, nqb, nv = plan.num_segments, plan.num_qblocks, plan.vkey_start[-1]
    if kbar is None:
        kbar = _segment_means(k, plan)
    _check_tensor(kbar, "kbar", torch.float32, (S, H, HEAD_DIM), device)
    seg, block, vcol = _token_maps(plan, device)

    qf = q.float().transpose(0, 1).contiguous()  # [H, T, 128]
    q_scales = F.fp8_scale(qf.abs().amax(-1))  # [H, T]
    q_codes = F.fp8_quantize(qf, q_scales.unsqueeze(-1))

    ks = _subtract(k, kbar[seg])  # [H, T, 128]
    k_amax = torch.zeros(H, nqb, dtype=torch.float32, device=device)
    k_amax.scatter_reduce_(1, block.expand(H, T), ks.abs().amax(-1), "amax")
    k_scales = F.fp8_scale(k_amax)  # [H, NQB]
    k_codes = F.fp8_quantize(ks, k_scales[:, block].unsqueeze(-1))

    vf = v.float()  # [T, H, 128]
    v_amax = torch.zeros(S, H, HEAD_DIM, dtype=torch.float32, device=device)
    v_amax.scatter_reduce_(0, seg[:, None, None].expand(vf.shape), vf.abs(), "amax")
    v_scales = F.fp8_scale(v_amax)  # [S, H, 128]
    vstart = torch.tensor(plan.vkey_start, dtype=torch.int64, device=device)[seg]
    vcol = vstart + fp8_v_column(vcol - vstart)  # keys permuted within 16-key groups
    v_codes = _transpose_v(F.fp8_quantize(vf, v_scales[seg]), vcol, nv)
    return {"kbar": kbar, "q_codes": q_codes, "q_scales": q_scales, "k_codes": k_codes,
            "k_scales": k_scales, "v_codes": v_codes, "v_scales": v_scales}


def window_order(columns: int, device: torch.device | None = None) -> torch.Tensor:
    """``key[p]``: the padded key column whose value padded position ``p`` holds in the window
    order of the Hopper NVFP4 kernel, for ``columns`` (a multiple of 64) positions: within every
    64-key window, position ``8i + 2t + e`` holds key ``16t + 2i + e`` (``layout.window_key_at``).
    Segments start on multiples of 64 padded columns, so the windows are the segments' own."""
    if columns % V_KEY_PAD:
        raise ValueError(f"columns must be a multiple of {V_KEY_PAD}, got {columns}")
    p = torch.arange(columns, device=device)
    return p - p % V_KEY_PAD + window_key_at(p)


def nvfp4_fp16_operands(stages: dict[str, torch.Tensor], cu_seqlens: CuSeqlens, *,
                        cu_seqlens_host: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The NVFP4 operands of ``stages`` (:func:`nvfp4_quantize_stages`, or a kernel's codes cut
    by :func:`trim_stages`) as the Hopper NVFP4 kernel reads them: ``q_f16``, ``k_f16``,
    ``v_f16`` (module doc table), every value ``s * code`` (exact in FP16, signed zeros kept:
    code 8 is -0). What the pre-pass of backend ``wgmma_fp16_nvfp4`` must write, bit for bit."""
    T = stages["q_codes"].shape[1]
    plan = _plan(cu_seqlens, T, cu_seqlens_host)
    nv = plan.vkey_start[-1]
    device = stages["q_codes"].device
    qhat = F.nvfp4_dequantize(stages["q_codes"], stages["q_scales"])  # [H, T, 128]
    khat = F.nvfp4_dequantize(stages["k_codes"], stages["k_scales"])  # [H, T, 128]
    vhat = F.nvfp4_dequantize(stages["v_codes"][..., : nv // 2],
                              stages["v_scales"][..., : nv // GROUP])  # [H, 128, NV]
    _, _, vcol = _token_maps(plan, device)
    kpad = torch.zeros(khat.shape[0], nv, HEAD_DIM, dtype=torch.float32, device=device)
    kpad.index_copy_(1, vcol, khat)  # key rows at their padded columns, zeros between
    order = window_order(nv, device)
    return {"q_f16": qhat.half(), "k_f16": kpad[:, order].half(),
            "v_f16": vhat[:, :, order].half()}


def trim_stages(op: str, stages: dict[str, torch.Tensor], cu_seqlens: CuSeqlens, *,
                cu_seqlens_host: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """Cut workspace views (``layout.views(ws)``) to the shapes of this call's stages.

    The layout sizes qbar / FP8 k_scales by ``q_blocks_cap`` and V by ``vkeys_cap``; the real
    call uses ``NQB`` blocks and ``vkey_start[S]`` columns, and the bytes past them are unused.
    """
    if op not in ("nvfp4", "fp8"):
        raise ValueError(f"op must be 'nvfp4' or 'fp8', got {op!r}")
    T = stages["q_codes"].shape[1]
    plan = _plan(cu_seqlens, T, cu_seqlens_host)
    nqb, nv = plan.num_qblocks, plan.vkey_start[-1]
    out = dict(stages)
    if op == "nvfp4":
        out["qbar"] = stages["qbar"][:nqb]
        out["v_codes"] = stages["v_codes"][..., : nv // 2]
        out["v_scales"] = stages["v_scales"][..., : nv // GROUP]
    else:
        out["k_scales"] = stages["k_scales"][:, :nqb]
        out["v_codes"] = stages["v_codes"][..., :nv]
    return out


# ---------------------------------------------------------------------------------------------
# Attention from the quantized operands
# ---------------------------------------------------------------------------------------------


def _exp2_rn(diff: torch.Tensor, c: float) -> torch.Tensor:
    """``fp32(exp2(fp32(diff * c)))`` for an FP32 ``diff`` (exp2 in FP64, rounded once)."""
    return torch.exp2((diff * c).double()).float()


def _query_rows(heads: int) -> int:
    """Rows per query chunk: a multiple of Q_BLOCK (so a chunk starts on a block boundary)."""
    return max(Q_BLOCK, _TILE_ELEMENTS // (heads * KV_TILE) // Q_BLOCK * Q_BLOCK)


def _online_softmax(scores, values: torch.Tensor, p_scale: float, quantize_p, c: float,
                    n: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC 3.6-3.8 / 4.3-4.4 for one query chunk: ``(O [H, rows, 128], l [H, rows])``, FP32.

    ``scores(j0, j1)`` gives the FP32 scores of keys ``[j0, j1)``; ``quantize_p(Ptil)`` the
    dequantized P of a tile (``[H, rows, w']``, ``w'`` columns of ``values`` used).
    """
    H, dev = values.shape[0], values.device
    m = torch.full((H, n), -math.inf, dtype=torch.float32, device=dev)
    l_sum = torch.zeros(H, n, dtype=torch.float32, device=dev)
    o = torch.zeros(H, n, HEAD_DIM, dtype=torch.float32, device=dev)
    for j0 in range(0, keys, KV_TILE):
        j1 = min(j0 + KV_TILE, keys)
        s = scores(j0, j1)  # [H, n, j1 - j0]
        m_new = torch.maximum(m, s.amax(-1))
        alpha = _exp2_rn(m - m_new, c)  # 0 on the first tile (m = -inf)
        p = _exp2_rn(s - m_new.unsqueeze(-1), c) * p_scale
        l_sum = l_sum * alpha + p.double().sum(-1).float()
        phat = quantize_p(p)
        pv = (phat.double() @ values[:, j0 : j0 + phat.shape[-1]]).float()
        o = o * alpha.unsqueeze(-1) + pv
        m = m_new
    return o, l_sum


def _nvfp4_p(p: torch.Tensor) -> torch.Tensor:
    """SPEC 3.7: P groups of 16 keys (the last one padded with zeros), dequantized."""
    pad = -p.shape[-1] % GROUP
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    return F.nvfp4_fake_quantize(p)


def _fp8_p(p: torch.Tensor) -> torch.Tensor:
    """SPEC 4.3: P stored as E4M3 (no block scale), dequantized."""
    return F.round_e4m3(p)


def _new_output(T: int, H: int, device: torch.device) -> torch.Tensor:
    # NaN-poisoned: a row the loops forget cannot pass a test.
    return torch.full((T, H, HEAD_DIM), math.nan, dtype=torch.bfloat16, device=device)


def _stages_plan(op: str, stages: dict[str, torch.Tensor], cu_seqlens: CuSeqlens,
                 cu_seqlens_host: Sequence[int] | None) -> HostPlan:
    """The plan of a call whose quantized operands are ``stages``, after checking them."""
    if not isinstance(stages, dict):
        raise TypeError(f"stages must be a dict of tensors, got {type(stages).__name__}")
    qc = stages.get("q_codes")
    if not isinstance(qc, torch.Tensor) or qc.dim() != 3:
        raise ValueError("stages['q_codes'] must be a [H, T, ...] uint8 tensor")
    H, T, dev = qc.shape[0], qc.shape[1], qc.device
    plan = _plan(cu_seqlens, T, cu_seqlens_host)
    S, nqb, nv = plan.num_segments, plan.num_qblocks, plan.vkey_start[-1]
    u8, f32, D = torch.uint8, torch.float32, HEAD_DIM
    cols = (False, False, True)
    if op == "nvfp4":
        specs = [("qbar", f32, (nqb, H, D), (True, False, False)),
                 ("q_codes", u8, (H, T, D // 2), None),
                 ("q_scales", u8, (H, T, D // GROUP), None),
                 ("k_codes", u8, (H, T, D // 2), None),
                 ("k_scales", u8, (H, T, D // GROUP), None),
                 ("v_codes", u8, (H, D, nv // 2), cols),
                 ("v_scales", u8, (H, D, nv // GROUP), cols)]
    else:
        specs = [("q_codes", u8, (H, T, D), None), ("q_scales", f32, (H, T), None),
                 ("k_codes", u8, (H, T, D), None), ("k_scales", f32, (H, nqb), (False, True)),
                 ("v_codes", u8, (H, D, nv), cols), ("v_scales", f32, (S, H, D), None)]
    for name, dtype, shape, at_least in specs:
        if name not in stages:
            raise ValueError(f"stages has no {name!r}")
        _check_tensor(stages[name], f"stages[{name!r}]", dtype, shape, dev, at_least)
    return plan


def nvfp4_attention_from_stages(stages: dict[str, torch.Tensor], cu_seqlens: CuSeqlens,
                                softmax_scale: float | None = None, *,
                                cu_seqlens_host: Sequence[int] | None = None,
                                query_blocks: Collection[int] | None = None) -> torch.Tensor:
    """SPEC 3.4-3.8 computed only from the quantized operands: bf16 ``[T, H, 128]``.

    Uses qbar, q/k/v codes and scales (kbar is not needed); workspace views may be passed
    uncut. Feeding a kernel's workspace through this checks its attention part alone.
    ``query_blocks``: only the rows of these 128-row blocks (canonical indices, plan.py) are
    computed, the others stay NaN (long segments: every key, a sample of the queries).
    """
    c = log2_softmax_scale(softmax_scale)
    plan = _stages_plan("nvfp4", stages, cu_seqlens, cu_seqlens_host)
    H, T, _ = stages["q_codes"].shape
    dev = stages["q_codes"].device
    out = _new_output(T, H, dev)
    step = _query_rows(H)
    for s, a, b in _segments(plan):
        L = b - a
        qhat = F.nvfp4_dequantize(stages["q_codes"][:, a:b], stages["q_scales"][:, a:b]).double()
        khat = F.nvfp4_dequantize(stages["k_codes"][:, a:b], stages["k_scales"][:, a:b]).double()
        c0, c1 = plan.vkey_start[s], plan.vkey_start[s + 1]
        vhat = F.nvfp4_dequantize(stages["v_codes"][:, :, c0 // 2 : c1 // 2],
                                  stages["v_scales"][:, :, c0 // GROUP : c1 // GROUP])
        vhat = vhat.transpose(1, 2).double()  # [H, padded keys, 128]
        g0, g1 = plan.qblock_start[s], plan.qblock_start[s + 1]
        qbar = stages["qbar"][g0:g1].permute(1, 0, 2).double()  # [H, blocks, 128]
        delta = (qbar @ khat.transpose(1, 2)).float()  # [H, blocks, L], SPEC 3.4
        if query_blocks is None:  # every row, in chunks of whole blocks
            chunks = [torch.arange(r0, min(r0 + step, L), device=dev) for r0 in range(0, L, step)]
        else:  # the selected blocks' rows, in one chunk
            rows = [torch.arange((g - g0) * Q_BLOCK, min((g - g0 + 1) * Q_BLOCK, L), device=dev)
                    for g in sorted(set(query_blocks)) if g0 <= g < g1]
            chunks = [torch.cat(rows)] if rows else []
        for rows in chunks:
            qc = qhat[:, rows]
            row_block = rows // Q_BLOCK

            def scores(j0: int, j1: int, qc=qc, row_block=row_block, delta=delta, khat=khat):
                dot = qc @ khat[:, j0:j1].transpose(1, 2)
                return (dot + delta[:, row_block, j0:j1].double()).float()

            o, l_sum = _online_softmax(scores, vhat, NVFP4_P_SCALE, _nvfp4_p, c, rows.numel(), L)
            out[a + rows] = F.div_rn(o, l_sum.unsqueeze(-1)).transpose(0, 1).bfloat16()
    return out


def fp8_attention_from_stages(stages: dict[str, torch.Tensor], cu_seqlens: CuSeqlens,
                              softmax_scale: float | None = None, *,
                              cu_seqlens_host: Sequence[int] | None = None) -> torch.Tensor:
    """SPEC 4.2-4.4 computed only from the quantized operands: bf16 ``[T, H, 128]``."""
    c = log2_softmax_scale(softmax_scale)
    plan = _stages_plan("fp8", stages, cu_seqlens, cu_seqlens_host)
    H, T, _ = stages["q_codes"].shape
    dev = stages["q_codes"].device
    out = _new_output(T, H, dev)
    step = _query_rows(H)
    for s, a, b in _segments(plan):
        L = b - a
        qval = F.e4m3_to_float(stages["q_codes"][:, a:b]).double()  # [H, L, 128]
        kval = F.e4m3_to_float(stages["k_codes"][:, a:b]).double()
        c0, c1 = plan.vkey_start[s], plan.vkey_start[s + 1]
        in_order = fp8_v_column(torch.arange(c1 - c0, device=dev))  # column of each key
        vcodes = stages["v_codes"][:, :, c0:c1][:, :, in_order]
        vval = F.e4m3_to_float(vcodes).transpose(1, 2).double()  # [H, keys in order, 128]
        g0 = plan.qblock_start[s]
        sv = stages["v_scales"][s].unsqueeze(1)  # [H, 1, 128]
        for r0 in range(0, L, step):
            r1 = min(r0 + step, L)
            qc = qval[:, r0:r1]
            sq = stages["q_scales"][:, a + r0 : a + r1]  # [H, n]

            def scores(j0: int, j1: int, qc=qc, sq=sq, kval=kval, g0=g0):
                sk = stages["k_scales"][:, g0 + j0 // KV_TILE].unsqueeze(-1)  # [H, 1]
                dot = (qc @ kval[:, j0:j1].transpose(1, 2)).float()
                return F.mul_rn(F.mul_rn(sq, sk).unsqueeze(-1), dot)

            o, l_sum = _online_softmax(scores, vval, FP8_P_SCALE, _fp8_p, c, r1 - r0, L)
            o = F.div_rn(F.mul_rn(o, sv), l_sum.unsqueeze(-1))
            out[a + r0 : a + r1] = o.transpose(0, 1).bfloat16()
    return out


# ---------------------------------------------------------------------------------------------
# The recipes and the oracle
# ---------------------------------------------------------------------------------------------


def varlen_attention_nvfp4_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     cu_seqlens: CuSeqlens, softmax_scale: float | None = None,
                                     *, cu_seqlens_host: Sequence[int] | None = None
                                     ) -> torch.Tensor:
    """The NVFP4 recipe (SPEC 3), step by step: bf16 ``[T, H, 128]`` on the device of ``q``."""
    _softmax_scale(softmax_scale)
    stages = nvfp4_quantize_stages(q, k, v, cu_seqlens, cu_seqlens_host=cu_seqlens_host)
    return nvfp4_attention_from_stages(stages, cu_seqlens, softmax_scale,
                                       cu_seqlens_host=cu_seqlens_host)


def varlen_attention_fp8_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens: CuSeqlens, softmax_scale: float | None = None,
                                   *, cu_seqlens_host: Sequence[int] | None = None
                                   ) -> torch.Tensor:
    """The FP8 recipe (SPEC 4), step by step: bf16 ``[T, H, 128]`` on the device of ``q``."""
    _softmax_scale(softmax_scale)
    stages = fp8_quantize_stages(q, k, v, cu_seqlens, cu_seqlens_host=cu_seqlens_host)
    return fp8_attention_from_stages(stages, cu_seqlens, softmax_scale,
                                     cu_seqlens_host=cu_seqlens_host)


def attention_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: CuSeqlens,
                     softmax_scale: float | None = None, *,
                     cu_seqlens_host: Sequence[int] | None = None) -> torch.Tensor:
    """Exact softmax attention per segment of the bf16 inputs: FP32 ``[T, H, 128]``.

    Computed in FP64 (one rounding to FP32 at the end), queries in chunks so that at most
    ``2**25`` scores live at once (a 32k-token segment at 56 heads stays within a few GB).
    """
    scale = _softmax_scale(softmax_scale)
    T, H, device = _check_qkv(q=q, k=k, v=v)
    plan = _plan(cu_seqlens, T, cu_seqlens_host)
    out = torch.full((T, H, HEAD_DIM), math.nan, dtype=torch.float32, device=device)
    for _, a, b in _segments(plan):
        L = b - a
        kd = k[a:b].double().permute(1, 2, 0)  # [H, 128, L]
        vd = v[a:b].double().transpose(0, 1)  # [H, L, 128]
        step = max(1, _ORACLE_ELEMENTS // (H * L))
        for r0 in range(0, L, step):
            r1 = min(r0 + step, L)
            s = (q[a + r0 : a + r1].double().transpose(0, 1) @ kd) * scale
            o = torch.softmax(s, dim=-1) @ vd
            out[a + r0 : a + r1] = o.transpose(0, 1).float()
    return out
