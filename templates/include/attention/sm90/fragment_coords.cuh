// Where a consumer thread's elements of a 64 x N wgmma accumulator sit (PTX ISA 9.7.15.5.1,
// "Register fragments and shared memory matrix layouts", the m64nNk* D fragment): warp w of the
// warpgroup holds rows 16w .. 16w + 15; lane l holds rows l / 4 and l / 4 + 8 of those and
// columns 2 (l % 4) and 2 (l % 4) + 1 of every 8-column chunk. Both Hopper attention kernels'
// consumers (fp8_kernel.cuh, nvfp4_kernel.cuh) index their S, P and O fragments by these.
#pragma once

#include "shared_storage.cuh"  // kWarpgroupThreads

namespace flashinfer_h3 {
namespace sm90 {

struct FragmentCoords {
  int quad_col;      // the first of the thread's two columns in each 8-column chunk
  int row_in_block;  // its first row in the item's 128-row query block (the other is + 8)

  // consumer: 0 or 1, the warpgroup's 64 rows of the block.
  __device__ __forceinline__ explicit FragmentCoords(int consumer) {
    const int tid = threadIdx.x % kWarpgroupThreads;  // unsigned: no sign fix-up
    const int warp = tid / 32, lane = tid % 32;
    quad_col = 2 * (lane % 4);
    row_in_block = 64 * consumer + 16 * warp + lane / 4;
  }
};

}  // namespace sm90
}  // namespace flashinfer_h3
