"""Workspace layouts: where the quantized operands of one call live.

The layout depends only on ``(tokens, heads, segments)``, never on the segment lengths, so
``workspace_bytes_*`` is exact for every call of that shape, and a workspace sized for a shape
serves every ``cu_seqlens`` with those counts. Per-length quantities use their upper bounds:

- ``q_blocks_cap``: 128-row blocks of all segments, ``sum ceil(L/128) <= (T + 127 S) // 128``
  (and ``<= T``, since every block holds a row).
- ``vkeys_cap``: keys of the transposed V once every segment is padded to a multiple of
  ``V_KEY_PAD`` keys, ``sum ceil(L/64)*64 <= 64 * ((T + 63 S) // 64)`` (and ``<= 64 T``).

Every region starts on a ``REGION_ALIGN``-byte boundary. Bytes between regions, and the V
columns past the last segment's padded end, are never read or written.

NVFP4 regions (``u8`` = raw bytes; E2M1 codes packed two per byte, lower element in the low
nibble; scales are UE4M3 bytes, one per 16 elements, lower group first):

==========  =====  ===========================  ==============================================
name        dtype  shape                        contents
==========  =====  ===========================  ==============================================
kbar        f32    [S, H, 128]                  per-segment mean of k (0 for empty segments)
qbar        f32    [q_blocks_cap, H, 128]       per-128-row-block mean of q, canonical block order
q_codes     u8     [H, T, 64]                   E2M1 codes of Q' = q - qbar, channels 2c, 2c+1
q_scales    u8     [H, T, 8]                    UE4M3 scale of channels 16j..16j+15
k_codes     u8     [H, T, 64]                   E2M1 codes of K' = k - kbar
k_scales    u8     [H, T, 8]
v_codes     u8     [H, 128, vkeys_cap / 2]      V transposed: row = channel, column = padded key
v_scales    u8     [H, 128, vkeys_cap / 16]     scale of padded keys 16t..16t+15 of that channel
==========  =====  ===========================  ==============================================

FP8 regions (codes are E4M3 with sign, scales FP32):

==========  =====  ===========================  ==============================================
kbar        f32    [S, H, 128]                  per-segment mean of k
q_codes     u8     [H, T, 128]                  E4M3 codes of q (no smoothing)
q_scales    f32    [H, T]                       per-token scale amax/448 (0 below 2^-126)
k_codes     u8     [H, T, 128]                  E4M3 codes of K' = k - kbar
k_scales    f32    [H, q_blocks_cap]            per 128-key block (same numbering as Q blocks)
v_codes     u8     [H, 128, vkeys_cap]          V transposed, padded as for NVFP4, FP8 key order
v_scales    f32    [S, H, 128]                  per (segment, channel) scale amax/448 (ditto)
==========  =====  ===========================  ==============================================

FP8 Hopper layout (``fp8_sm90``, the kernel ``wgmma_fp8``): the FP8 regions, then
``item_counter`` (i32 [1], below).

FP8 key order: within each 16-key group (from the segment start) key ``8h + 2q + e`` is stored at
column ``4q + 2h + e`` (``reference.fp8_v_column``), the order in which an FP8 MMA's accumulator
holds P, so P packs into the PV product's A operand without shuffles.

NVFP4 FP16 regions (layout ``nvfp4_fp16``, the Hopper kernel ``wgmma_fp16_nvfp4``): the means,
then the NVFP4 operands as the pre-pass's FP16 output policy writes them (each value
``scale * code``, exact in FP16; no codes or scales are stored), in the shapes TMA reads them:

==========  =====  ===========================  ==============================================
kbar        f32    [S, H, 128]                  per-segment mean of k, as above
qbar        f32    [q_blocks_cap, H, 128]       per-128-row-block mean of q, as above
q_f16       f16    [H, T, 128]                  Q' rows in token order
k_f16       f16    [H, vkeys_cap, 128]          K' rows at padded key positions, window order
v_f16       f16    [H, 128, vkeys_cap]          V^T columns at the same positions; launch 1 of
                                                the pre-pass parks its k block sums in its
                                                used columns before launch 3 writes them
item_counter i32   [1]                          the Hopper kernel's dynamic item order (below)
==========  =====  ===========================  ==============================================

``item_counter``: the Hopper kernels' dynamic item order (``wgmma_fp16_nvfp4``; for ``wgmma_fp8``
a benchmark build) draws the persistent CTAs' next (block, head) items from it
(``attention/sm90/tile_scheduler.cuh``); the binding zeroes it before each such launch. Nothing
else reads or writes it.

Window order: within each 64-key window from the segment start, position ``8i + 2t + e`` holds
key ``16t + 2i + e`` (:func:`window_key_at`), so that a wgmma accumulator thread holds whole
16-key P groups; positions past a segment's last key hold zeros (K and V alike).

Padded V keys: segment ``s`` owns padded key columns ``[vkey_start[s], vkey_start[s+1])`` (see
``plan.py``); the columns past its last real key hold code 0 and scale 0 (written by the
pre-pass, so a kernel reading a whole 64-key chunk never meets stale bytes).

Block numbering ("canonical order"): segment by segment, then by block index within the segment;
segment ``s`` owns blocks ``[qblock_start[s], qblock_start[s+1])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .constants import HEAD_DIM

Q_BLOCK = 128  # rows per Q block (Q smoothing, attention CTA) and keys per FP8 K-scale block
V_KEY_PAD = 64  # every segment's transposed-V columns are padded to a multiple of this
GROUP = 16  # elements per NVFP4 scale
REGION_ALIGN = 256


def q_blocks_cap(tokens: int, segments: int) -> int:
    """Upper bound of ``sum ceil(L/128)`` over any segmentation of ``tokens`` into ``segments``."""
    return min(tokens, (tokens + (Q_BLOCK - 1) * segments) // Q_BLOCK)


def vkeys_cap(tokens: int, segments: int) -> int:
    """Upper bound of ``sum ceil(L/64)*64`` over any segmentation (a multiple of 64)."""
    chunks = min(tokens, (tokens + (V_KEY_PAD - 1) * segments) // V_KEY_PAD)
    return chunks * V_KEY_PAD


@dataclass(frozen=True)
class Region:
    name: str
    offset: int  # bytes from the workspace start
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n

    def view(self, workspace: torch.Tensor) -> torch.Tensor:
        """This region of a flat ``uint8`` workspace as a typed, shaped tensor (no copy)."""
        raw = workspace[self.offset : self.offset + self.nbytes]
        return raw.view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class WorkspaceLayout:
    op: str  # "nvfp4" | "nvfp4_fp16" | "fp8" | "fp8_sm90"
    tokens: int
    heads: int
    segments: int
    regions: tuple[Region, ...]
    total_bytes: int

    def __getitem__(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def views(self, workspace: torch.Tensor) -> dict[str, torch.Tensor]:
        if workspace.dtype != torch.uint8 or workspace.dim() != 1:
            raise ValueError("workspace must be a flat uint8 tensor")
        if workspace.numel() < self.total_bytes:
            raise ValueError(
                f"workspace has {workspace.numel()} bytes, the {self.op} layout needs "
                f"{self.total_bytes}"
            )
        return {r.name: r.view(workspace) for r in self.regions}


def _align(n: int) -> int:
    return (n + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN


def _pack(op: str, tokens: int, heads: int, segments: int, specs) -> WorkspaceLayout:
    regions = []
    offset = 0
    for name, dtype, shape in specs:
        region = Region(name, offset, dtype, tuple(int(d) for d in shape))
        regions.append(region)
        offset = _align(offset + region.nbytes)
    return WorkspaceLayout(op, tokens, heads, segments, tuple(regions), offset)


def _check_counts(tokens: int, heads: int, segments: int) -> None:
    for name, value, lo in (("tokens", tokens, 0), ("num_heads", heads, 1),
                            ("num_segments", segments, 0)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")
    if tokens > 0 and segments == 0:
        raise ValueError(f"{tokens} tokens need at least one segment")


def nvfp4_layout(tokens: int, heads: int, segments: int) -> WorkspaceLayout:
    _check_counts(tokens, heads, segments)
    T, H, S, D = tokens, heads, segments, HEAD_DIM
    nqb, nvk = q_blocks_cap(T, S), vkeys_cap(T, S)
    u8, f32 = torch.uint8, torch.float32
    return _pack("nvfp4", T, H, S, [
        ("kbar", f32, (S, H, D)),
        ("qbar", f32, (nqb, H, D)),
        ("q_codes", u8, (H, T, D // 2)),
        ("q_scales", u8, (H, T, D // GROUP)),
        ("k_codes", u8, (H, T, D // 2)),
        ("k_scales", u8, (H, T, D // GROUP)),
        ("v_codes", u8, (H, D, nvk // 2)),
        ("v_scales", u8, (H, D, nvk // GROUP)),
    ])


def nvfp4_fp16_layout(tokens: int, heads: int, segments: int) -> WorkspaceLayout:
    """The means and the FP16 operands of the Hopper NVFP4 kernel (``wgmma_fp16_nvfp4``), which
    its pre-pass writes directly (see the module doc), and the kernel's item counter."""
    _check_counts(tokens, heads, segments)
    T, H, S, D = tokens, heads, segments, HEAD_DIM
    nqb, nvk = q_blocks_cap(T, S), vkeys_cap(T, S)
    f16, f32 = torch.float16, torch.float32
    return _pack("nvfp4_fp16", T, H, S, [
        ("kbar", f32, (S, H, D)),
        ("qbar", f32, (nqb, H, D)),
        ("q_f16", f16, (H, T, D)),
        ("k_f16", f16, (H, nvk, D)),
        ("v_f16", f16, (H, D, nvk)),
        ("item_counter", torch.int32, (1,)),
    ])


def window_key_at(position: Any) -> Any:
    """The key (within its 64-key window from the segment start) that ``k_f16`` row / ``v_f16``
    column ``position`` of the window holds (attention/sm90/nvfp4_key_order.cuh). ``position``
    may be an int or an integer tensor (elementwise)."""
    p = position % V_KEY_PAD
    return 16 * ((p >> 1) & 3) + 2 * (p >> 3) + (p & 1)


def fp8_layout(tokens: int, heads: int, segments: int) -> WorkspaceLayout:
    _check_counts(tokens, heads, segments)
    T, H, S, D = tokens, heads, segments, HEAD_DIM
    nqb, nvk = q_blocks_cap(T, S), vkeys_cap(T, S)
    u8, f32 = torch.uint8, torch.float32
    return _pack("fp8", T, H, S, [
        ("kbar", f32, (S, H, D)),
        ("q_codes", u8, (H, T, D)),
        ("q_scales", f32, (H, T)),
        ("k_codes", u8, (H, T, D)),
        ("k_scales", f32, (H, nqb)),
        ("v_codes", u8, (H, D, nvk)),
        ("v_scales", f32, (S, H, D)),
    ])


def fp8_sm90_layout(tokens: int, heads: int, segments: int) -> WorkspaceLayout:
    """The FP8 regions and the Hopper FP8 kernel's (``wgmma_fp8``) item counter."""
    base = fp8_layout(tokens, heads, segments)
    specs = [(r.name, r.dtype, r.shape) for r in base.regions]
    specs.append(("item_counter", torch.int32, (1,)))
    return _pack("fp8_sm90", tokens, heads, segments, specs)


def workspace_bytes_nvfp4(tokens: int, num_heads: int, num_segments: int) -> int:
    """Exact workspace size, in bytes, of an NVFP4 call with these counts."""
    return nvfp4_layout(tokens, num_heads, num_segments).total_bytes


def workspace_bytes_fp8(tokens: int, num_heads: int, num_segments: int) -> int:
    """Exact workspace size, in bytes, of an FP8 call with these counts."""
    return fp8_layout(tokens, num_heads, num_segments).total_bytes
