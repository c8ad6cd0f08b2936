// Work items of the Hopper attention kernels and their persistent static schedule.
//
// An item is one (128-row query block, head). The plan's `qblocks` table lists the blocks of all
// segments longest segment first (flashinfer_h3/plan.py), and item w is block w % NQB of head
// w / NQB: the CTAs running at the same time work on one or two heads, so the K and V tiles they
// stream are shared through L2 (all 56 heads interleaved would stream every head's K/V from DRAM).
// CTAs take items w = blockIdx.x, blockIdx.x + gridDim.x, ...; empty segments own no block, so they
// cost nothing.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace sm90 {

struct WorkItem {
  int head;
  int segment;
  int row_begin;  // first query row of the block (absolute token index)
  int row_end;    // one past its last row (<= the segment's end)
  int seg_begin;  // the segment's first key
  int seg_len;    // its length: keys [seg_begin, seg_begin + seg_len)
  int vcol0;      // its first padded column of the transposed V
  int kblock0;    // canonical index of its first 128-key block (FP8 K scales)
  int canonical;  // the block's canonical index (NVFP4 qbar)
};

struct PlanTables {
  const int32_t* seg_bounds;    // [S + 1]
  const int32_t* vkey_start;    // [S + 1]
  const int32_t* qblock_start;  // [S + 1]
  const int32_t* qblocks;       // [NQB, 4]: (segment, row_begin, row_end, canonical index), schedule order
  int num_qblocks;
  int heads;
};

__device__ __forceinline__ int num_items(const PlanTables& t) { return t.num_qblocks * t.heads; }

// w < num_items(t) for w >= 0 (num_qblocks >= 1: the bindings launch nothing without blocks),
// written as head < heads: the loop condition then needs no product held in a register across
// the item (the quotient is work_item's head, computed once for both).
__device__ __forceinline__ bool has_item(const PlanTables& t, int w) { return w / t.num_qblocks < t.heads; }

__device__ __forceinline__ WorkItem work_item(const PlanTables& t, int w) {
  const int head = w / t.num_qblocks;
  // Four scalar loads: the table is a view into the plan's buffer, only 4-byte aligned.
  const int32_t* b = t.qblocks + 4 * (w - head * t.num_qblocks);
  WorkItem it;
  it.head = head;
  it.segment = __ldg(b);
  it.row_begin = __ldg(b + 1);
  it.row_end = __ldg(b + 2);
  it.seg_begin = __ldg(t.seg_bounds + it.segment);
  it.seg_len = __ldg(t.seg_bounds + it.segment + 1) - it.seg_begin;
  it.vcol0 = __ldg(t.vkey_start + it.segment);
  it.kblock0 = __ldg(t.qblock_start + it.segment);
  it.canonical = __ldg(b + 3);
  return it;
}

}  // namespace sm90
}  // namespace flashinfer_h3
