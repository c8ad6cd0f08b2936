// The key order of the Hopper NVFP4 kernel's K and V^T tiles (docs/design.md, "The Hopper NVFP4
// kernel"): within every 64-key window counted from the segment start, position
//     p = 8 i + 2 t + e      (i < 8, t < 4, e < 2)     holds key     16 t + 2 i + e.
// A wgmma accumulator gives thread t of a quad the columns 8 i + 2 t + e of its rows, so with this
// order the 16 scores a thread holds per row and window are one P group (16 consecutive keys from
// the segment start, SPEC 3.7): the group maximum needs no shuffle, and each group's scale is
// computed once instead of by all four threads. The order is a permutation of each window, so the
// segment's padded length (a multiple of 64, flashinfer_h3/layout.py) holds it exactly, and V^T
// columns use the same positions as K rows, which keeps P V unchanged.
#pragma once

namespace flashinfer_h3 {
namespace sm90 {

constexpr int kKeyWindow = 64;

// The key (within its window) that window position p holds.
__host__ __device__ constexpr int window_key_at(int p) { return 16 * ((p >> 1) & 3) + 2 * (p >> 3) + (p & 1); }

// The key that position p of a tile (a whole number of windows) holds, counted from the tile's
// first key.
__host__ __device__ constexpr int tile_key_at(int p) {
  return (p & ~(kKeyWindow - 1)) + window_key_at(p & (kKeyWindow - 1));
}

// The window position of key k (the inverse).
__host__ __device__ constexpr int window_position_of(int k) { return 8 * ((k >> 1) & 7) + 2 * (k >> 4) + (k & 1); }

}  // namespace sm90
}  // namespace flashinfer_h3
