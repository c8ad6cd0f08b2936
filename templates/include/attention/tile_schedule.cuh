// Tile scheduling shared by the attention kernels: which (128-row query block, head) a CTA (or a
// persistent CTA's work item) handles, and where its segment's keys and padded V columns are.
//
// The plan (flashinfer_h3/plan.py) lists the query blocks in schedule order, longest segment
// first; work item x = schedule_index * heads + head, so the hardware's in-order dispatch starts
// every head of the longest segments first and no grid dimension meets the 65,535 limit of y.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace attention {

struct QBlockTile {
  int head;
  int segment;
  int row_begin, row_end;  // the block's query rows
  int canonical;           // the block's canonical index (qbar row, FP8 K-scale block numbering)
  int64_t seg_begin;       // first token of the segment
  int seg_len;             // keys of the segment
  int64_t v_col_begin;     // first padded V column of the segment
  int v_padded_len;        // its padded V columns (a multiple of 64)
};

// Work item `item` of the plan tables: qblocks [NQB, 4] (segment, row_begin, row_end,
// canonical) in schedule order, seg_bounds [S + 1], vkey_start [S + 1]. `item` is unsigned, as
// blockIdx.x: the division is the one the kernels were tested with. Fields a kernel does not
// read cost nothing (their loads are dropped).
__device__ __forceinline__ QBlockTile qblock_tile(unsigned item, int heads, const int32_t* qblocks,
                                                  const int32_t* seg_bounds,
                                                  const int32_t* vkey_start) {
  QBlockTile t;
  const int blk = item / heads;
  t.head = item - blk * heads;
  const int seg = qblocks[4 * blk + 0];
  t.segment = seg;
  t.row_begin = qblocks[4 * blk + 1];
  t.row_end = qblocks[4 * blk + 2];
  t.canonical = qblocks[4 * blk + 3];
  t.seg_begin = seg_bounds[seg];
  t.seg_len = seg_bounds[seg + 1] - seg_bounds[seg];
  t.v_col_begin = vkey_start[seg];
  t.v_padded_len = vkey_start[seg + 1] - vkey_start[seg];
  return t;
}

}  // namespace attention
}  // namespace flashinfer_h3
