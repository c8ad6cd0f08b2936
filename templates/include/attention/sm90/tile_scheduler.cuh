// Work items of the Hopper attention kernels and the persistent CTAs' item order.
//
// An item is one (128-row query block, head). The plan's `qblocks` table lists the blocks of all
// segments longest segment first (flashinfer_h3/plan.py), and item w is block w % NQB of head
// w / NQB: the CTAs running at the same time work on one or two heads, so the K and V tiles they
// stream are shared through L2 (all 56 heads interleaved would stream every head's K/V from DRAM).
// Empty segments own no block, so they cost nothing.
//
// Which CTA takes which item:
// - striding (the NVFP4 kernel's static builds): CTA b takes w = b, b + G, b + 2G, ...
//   (G = gridDim.x);
// - a host-made list (the FP8 kernel's order, ItemSchedule): CTA b takes the items of its run
//   of the plan's cta_items table. flashinfer_h3/plan.py deals the items in order to the CTA
//   with the least work so far (in 256-key tiles plus an item's fixed cost), the balance of the
//   dynamic order without its per-item atomic and hand-off; a call captured into a CUDA graph
//   gets striding in this form (plan.striding_schedule);
// - dynamic (the NVFP4 kernel's): CTA b takes w = b first, then G + the next value of a global
//   counter (the workspace's item_counter; the binding zeroes it before each launch), drawn by
//   the producer thread once it has issued the copies of its current item's last tile. A CTA
//   that finishes early takes the next item in the same order, so the CTAs stay on a window of
//   consecutive items. With packed segments of different lengths the static striding lets the
//   CTAs drift apart over many heads (one CTA still in a 240-tile item of head h while others
//   run ahead through short items of later heads): more K/V in flight than L2 holds, and an
//   uneven last wave. On h3-mix the static NVFP4 kernel ran 3.1 % longer than its six segment
//   lengths alone predict, and the dynamic order takes 3.5 % off it (FP8: 0.3 % predicted, and
//   the dynamic order measured 2-4 % slower on every preset: Nsight Compute puts it at the item
//   boundaries, where each item start waits for the plan-table loads twice); see
//   benchmarks/RESULTS.md. The producer hands each item index to the readers (the consumers and
//   the NVFP4 delta warpgroup) through shared memory (ItemSlot), published by the q_full arrival
//   that starts the item; an index past the end (the terminator) arrives without a Q copy and
//   ends the CTA's loops.
#pragma once

#include <stdint.h>

#include "../../ptx/mbarrier.cuh"
#include "../../ptx/smem_addr.cuh"

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

// A static order computed by the host (flashinfer_h3/plan.py): CTA b takes the items
// items[cta_begin[b]] .. items[cta_begin[b + 1] - 1], in that order (with clusters of two CTAs,
// schedule_item, the two runs of a cluster pair up entry by entry).
struct ItemSchedule {
  const int32_t* cta_begin;  // [gridDim.x + 1]
  const int32_t* items;      // each CTA's run in turn

  __device__ __forceinline__ int begin() const { return __ldg(cta_begin + blockIdx.x); }
  __device__ __forceinline__ int end() const { return __ldg(cta_begin + blockIdx.x + 1); }
  __device__ __forceinline__ int item(int i) const { return __ldg(items + i); }
};

// Clusters of two CTAs (the FP8 kernel's): a cluster's unit of work is a pair of query blocks of
// one segment and head, which read the same K and V tiles, so each CTA copies half of every tile
// into both (tma_load_3d_multicast) and the pair moves half the bytes from L2 that two
// independent CTAs would. The two CTAs' runs have the same length and entry j of each is one
// block of the pair (flashinfer_h3/plan.py item_schedule); a segment with an odd block count ends
// in a pair whose second entry is the first block flagged kNoRows: that CTA runs the tiles for
// the copies' sake and stores nothing (row_begin = row_end).
constexpr int kNoRows = 1 << 30;

template <int kCtas>
__device__ __forceinline__ WorkItem schedule_item(const PlanTables& plan, const ItemSchedule& schedule, int i) {
  static_assert(kCtas == 1 || kCtas == 2, "clusters of one or two CTAs");
  if constexpr (kCtas == 1) {
    return work_item(plan, schedule.item(i));
  } else {
    const int code = schedule.item(i);
    WorkItem it = work_item(plan, code & ~kNoRows);
    if ((code & kNoRows) != 0) it.row_begin = it.row_end;
    return it;
  }
}

// The dynamic order's shared-memory hand-off: the producer writes the index of the item it
// starts before the q_full arrival that publishes it; every reader thread reads it right after
// its q_full wait and arrives on `empty`, which the producer waits for before it writes the next
// one (a direct arrive -> wait per reader, which compute-sanitizer's racecheck follows: through
// q_empty, which one thread per consumer warpgroup arrives on, it reported the other threads'
// reads). The readers decode the index with work_item like the static order (the decoded entries
// from shared memory instead made the FP8 consumers hold them in registers and spill).
struct ItemSlot {
  uint64_t empty;  // mbarrier; init_barriers: one arrival per reader thread
  int w;           // the item index (>= num_items: the terminator)
  int* counter;    // the global counter (Params::item_counter), stored once at the kernel's start

  // Through the slot's shared-memory address (ptx::st_shared_b32): the producer's generic
  // pointer to it, held in its 24 registers across the tile loop, pushed it into spills.
  __device__ __forceinline__ void publish(int item) { ptx::st_shared_b32(ptx::smem_addr(&w), static_cast<uint32_t>(item)); }
  __device__ __forceinline__ int read() {
    const int item = static_cast<int>(ptx::ld_shared_b32(ptx::smem_addr(&w)));
    ptx::mbarrier_arrive(&empty);
    return item;
  }
};

// The dynamic order's next item of this CTA: G + the counter's next value (one atomic of the
// producer thread; relaxed: only the values' uniqueness matters; the counter is zero at launch).
__device__ __forceinline__ int draw_item(const ItemSlot& slot) {
  return static_cast<int>(gridDim.x) + atomicAdd(slot.counter, 1);
}

}  // namespace sm90
}  // namespace flashinfer_h3
