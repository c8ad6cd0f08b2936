"""The index math of the mma.sync FP8 kernel
(templates/include/attention/mma_sync/attention_fp8.cuh) checked on a model of one warp and
one 64-key tile, with exact integer arithmetic.

The model follows the PTX ISA's definitions: the m16n8k32 E4M3 fragments (§9.7.14.5.10: A
register r holds row g (+8 for odd r), k 4t..4t+3 (+16 for r >= 2); B b0/b1 col g, k 4t.. /
16+4t..; C/D (g or g+8, 2t, 2t+1)) and ldmatrix.x4 (lane 4g+t gets bytes 4t..4t+3 of row g of
matrix m from the row addresses of lanes 8m..8m+7). On it run the kernel's copy placement and
swizzles, its ldmatrix addresses, its S accumulator -> key mapping, the P packing straight from
the accumulator and the V key order of the pre-pass (``reference.fp8_v_column``, the package's
own function): Q K^T and P V must come out exactly, and every ldmatrix must be free of bank
conflicts. A change of the V key order or of the kernel's fragment bookkeeping that breaks the
no-shuffle P path shows here first (the GPU tests show it as a wrong result).
"""

from __future__ import annotations

import numpy as np
import torch

from flashinfer_h3.reference import fp8_v_column

TILE_KEYS, D = 64, 128


def k_off(row: int, chunk: int) -> int:  # K tile [64][128 B]
    return row * 128 + 16 * (chunk ^ (row & 7))


def v_off(row: int, chunk: int) -> int:  # V^T tile [128][64 B]
    return row * 64 + 16 * (chunk ^ ((row >> 1) & 3))


def ldmatrix_x4(smem: np.ndarray, addrs: list[int]) -> list[list[np.ndarray]]:
    return [[smem[addrs[8 * m + (lane >> 2)] + 4 * (lane & 3):][:4] for m in range(4)]
            for lane in range(32)]


def mma(d: list[list[int]], a: list[list[np.ndarray]], b0: list, b1: list) -> None:
    """d += A B for one m16n8k32 E4M3 product given per-lane fragments."""
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(16):
            row = g if (i < 4 or 8 <= i < 12) else g + 8
            A[row, 4 * t + (i & 3) + (16 if i >= 8 else 0)] = a[lane][i // 4][i % 4]
        for i in range(8):
            B[4 * t + (i & 3) + (16 if i >= 4 else 0), g] = (b0 if i < 4 else b1)[lane][i % 4]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(4):
            d[lane][i] += C[g + 8 * (i >= 2), 2 * t + (i & 1)]


def _zeros(n: int) -> list[list[list[int]]]:
    return [[[0] * 4 for _ in range(32)] for _ in range(n)]


def test_one_tile_of_one_warp_is_exact() -> None:
    rng = np.random.default_rng(0)
    Q = rng.integers(-3, 4, (16, D))
    K = rng.integers(-3, 4, (TILE_KEYS, D))
    V = rng.integers(-3, 4, (TILE_KEYS, D))
    P = rng.integers(0, 5, (16, TILE_KEYS))  # stands for Ptil after the softmax

    # The pre-pass's V^T (keys permuted in 16s) and the kernel's copy into shared memory.
    cols = fp8_v_column(torch.arange(TILE_KEYS)).numpy()
    vt = np.zeros((D, TILE_KEYS), np.int64)
    vt[:, cols] = V.T
    ksm = np.full(TILE_KEYS * 128, -10**6, np.int64)
    vsm = np.full(D * 64, -10**6, np.int64)
    for tid in range(256):
        row, x = tid >> 2, tid & 3
        for c in range(2):
            ksm[k_off(row, 2 * x + c):][:16] = K[row, 32 * x + 16 * c:][:16]
        row, h = tid >> 1, tid & 1
        for c in range(2):
            vsm[v_off(row, 2 * h + c):][:16] = vt[row, 32 * h + 16 * c:][:16]
    assert (ksm > -10**6).all() and (vsm > -10**6).all(), "the copy leaves a hole"

    # QK^T: k32 steps outer, Q fragments from the row-major codes, two n8 tiles per ldmatrix.
    s = _zeros(8)
    for k in range(4):
        a = [[Q[(lane >> 2) + 8 * (r & 1), 32 * k + 4 * (lane & 3) + 16 * (r >> 1):][:4]
              for r in range(4)] for lane in range(32)]
        for i in range(0, 8, 2):
            b = ldmatrix_x4(ksm, [k_off(8 * (i + (ln >> 4)) + (ln & 7), 2 * k + ((ln >> 3) & 1))
                                  for ln in range(32)])
            mma(s[i], a, [x[0] for x in b], [x[1] for x in b])
            mma(s[i + 1], a, [x[2] for x in b], [x[3] for x in b])
    S = Q @ K.T
    for i in range(8):
        for lane in range(32):
            for e in range(4):  # scale_and_mask's key of element e
                key = 8 * i + 2 * (lane & 3) + (e & 1)
                assert s[i][lane][e] == S[(lane >> 2) + 8 * (e >> 1), key]

    # P in the accumulator layout, packed as pack_p (cvt puts its first value in the low byte).
    p = [[[P[(lane >> 2) + 8 * (e >> 1), 8 * i + 2 * (lane & 3) + (e & 1)] for e in range(4)]
          for lane in range(32)] for i in range(8)]
    pa = []
    for k in range(2):
        regs = [[None] * 4 for _ in range(32)]
        for h in range(2):
            tile = 4 * k + 2 * h
            for r in range(2):
                for lane in range(32):
                    regs[lane][2 * h + r] = [p[tile][lane][2 * r], p[tile][lane][2 * r + 1],
                                             p[tile + 1][lane][2 * r],
                                             p[tile + 1][lane][2 * r + 1]]
        pa.append(regs)

    # PV: two n8 channel tiles per ldmatrix, a fresh accumulator per pair, added into O.
    o = _zeros(16)
    for j in range(0, 16, 2):
        acc = _zeros(2)
        for k in range(2):
            b = ldmatrix_x4(vsm, [v_off(8 * (j + (ln >> 4)) + (ln & 7), 2 * k + ((ln >> 3) & 1))
                                  for ln in range(32)])
            mma(acc[0], pa[k], [x[0] for x in b], [x[1] for x in b])
            mma(acc[1], pa[k], [x[2] for x in b], [x[3] for x in b])
        for x in range(2):
            for lane in range(32):
                for e in range(4):
                    o[j + x][lane][e] += acc[x][lane][e]
    pv = P @ V
    for j in range(16):
        for lane in range(32):
            for e in range(4):
                col = 8 * j + 2 * (lane & 3) + (e & 1)
                assert o[j][lane][e] == pv[(lane >> 2) + 8 * (e >> 1), col]


def test_ldmatrix_reads_are_conflict_free() -> None:
    for off, rows, chunks in ((k_off, TILE_KEYS, 8), (v_off, D, 4)):
        for base in range(0, rows, 8):
            for chunk in range(chunks):
                groups = {(off(base + r, chunk) % 128) // 16 for r in range(8)}
                assert len(groups) == 8, (off.__name__, base, chunk)
