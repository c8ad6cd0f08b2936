// Microbenchmarks of the Hopper attention kernels' parts, in SM cycles, on the kernels' own device
// functions (attention/sm90/*.cuh): one GEMM phase, one softmax step, one consumer tile, each
// alone, beside another warpgroup's GEMMs, and the two consumers' loop in the ping-pong, all on
// operands that sit in shared memory (no TMA, no L2, no ring waits).
//
// Why: the FP8 kernel takes ~2,475 cycles per pair of consumer tiles at 61,440 x 56 (132 ms at
// ~1.83 GHz), where its tensor work is 1,024 cycles and its MUFU work ~960 (benchmarks/RESULTS.md,
// 2026-12-01). These numbers say which part of the period is the consumers' own chain (GEMM issue
// and wait, softmax, O update, the turn) and which comes from outside it (tiles, L2, power).
//
// The "nvfp4 loop" rows ask whether a third consumer warpgroup would keep the tensor pipe busier
// (NVFP4 consumers run their GEMM phase, then ~1,400-2,300 cycles of softmax: the pipe idles half
// the period): the same consumer tile loop for 2 consumers on 128-key tiles (today's schedule) and
// for 3 consumers on 64-key tiles (S 32 + O 64 + P 16 registers, to fit 160 a thread), each GEMM
// phase handing the tensor cores to the next consumer in a round-robin turn. Their last column is
// the throughput that decides it: query-row x key pairs per SM cycle (the FP16 tensor peak is 8:
// 4,096 FLOP a cycle, 512 a row-key at head dim 128).
//
// Build and run on the GPU (benchmarks/h200_session.sh diagnose does both):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I templates/include benchmarks/sm90_pipes.cu \
//       -o /tmp/sm90_pipes
//   /tmp/sm90_pipes [--json FILE]
// One CTA of 384 threads per SM, as the kernels: warpgroup 0 gives its registers away and idles,
// warpgroups 1 and 2 run the roles of an experiment. A "measured" warpgroup times its loop with
// clock64; a "background" one runs the same number of iterations times kBackgroundFactor, so that
// it outlasts the measured one (its own time is printed to show that it did). The "nvfp4 loop"
// rows launch 384 or 512 threads (2 or 3 consumer warpgroups after the idle one).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attention/sm90/fp8_kernel.cuh"
#include "attention/sm90/nvfp4_kernel.cuh"

namespace {

namespace fh3 = flashinfer_h3;
namespace sm90 = flashinfer_h3::sm90;
namespace ptx = flashinfer_h3::ptx;

// ---- operands --------------------------------------------------------------------------------

// The "nvfp4 loop" experiments' Q: 64 rows for each of up to three consumers, as two atoms of 192
// rows x 64 f16 in the 128-byte swizzle (1024-byte multiples: every consumer's rows stay aligned).
constexpr int kLoopMaxConsumers = 3;
constexpr int kLoopQAtomBytes = kLoopMaxConsumers * 64 * 128;

// One set of operand tiles per CTA, 1024-byte aligned (the 128-byte swizzle's atom): FP8 Q rows
// of both consumers, a K and a V^T tile (the FP8 kernel's 8 + 8 + 16 + 16 KB), and the f16 tiles
// of the NVFP4 kernel (Q 2 atoms, K and V^T 2 atoms each). The bytes are random with bit 3 and
// bit 6 clear: finite both as E4M3 (no exponent 1111) and as FP16 (exponent < 11111).
struct alignas(1024) Operands {
  uint8_t fp8_q[sm90::kBlockRows * sm90::kHeadDim];
  uint8_t fp8_k[sm90::kTileBytes];
  uint8_t fp8_v[sm90::kTileBytes];
  uint8_t f16_q[2][sm90::kFp16AtomBytes];
  uint8_t f16_k[2][sm90::kFp16AtomBytes];
  uint8_t f16_v[2][sm90::kFp16AtomBytes];
  uint8_t f16_q_loop[2][kLoopQAtomBytes];  // Q of the "nvfp4 loop" consumers: rows 64c.. of consumer c
  float delta[2][sm90::kTileKeys];  // two buffers (delta_as_scores_of_iteration)
  float recip[sm90::kScaleCodes];
  sm90::PScaleFold p_fold[sm90::kScaleCodes];
};
constexpr size_t kSmemBytes = sizeof(Operands) + 1024;  // + the alignment slack
static_assert(kSmemBytes <= 227 * 1024, "Hopper allows 227 KB of shared memory per block");

__device__ void fill_operands(Operands& op) {
  uint32_t* words = reinterpret_cast<uint32_t*>(&op);
  const int n = static_cast<int>(offsetof(Operands, delta) / 4);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    uint32_t h = (i + 1) * 0x9E3779B9u ^ (blockIdx.x * 0x85EBCA6Bu);
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    words[i] = h & 0xB7B7B7B7u;
  }
  for (int i = threadIdx.x; i < sm90::kTileKeys; i += blockDim.x) {
    op.delta[0][i] = op.delta[1][i] = 0.01f * (i % 7);
  }
  for (int b = threadIdx.x; b < sm90::kScaleCodes; b += blockDim.x) sm90::fill_p_scale_table<true>(b, op.recip, op.p_fold);
}

// Softmax constants of a realistic range: the FP8 scores are dot products of codes below 1 in
// magnitude (|dot| ~ 10), sq sk c = 0.3 puts the exponents in about [-10, 8].
constexpr float kFp8Sk = 0.3f;
constexpr float kC = 1.0f;
constexpr float kNvfp4C = 0.127f;  // NVFP4 scores: f16 dots ~ 10-ish, 2^(S c) over a few octaves

// ---- roles -----------------------------------------------------------------------------------

enum Role : int {
  kIdle,
  kFp8QK,          // S = Q K^T: 4 x m64n128k32 SS, commit, wait
  kFp8PV,          // Otmp = P V: 4 x m64n128k32 RS, commit, wait
  kFp8Phase,       // the FP8 kernel's GEMM phase: PV then QK^T, one commit each, wait for both
  kFp8Softmax,     // fp8_softmax_tile (unmasked), S in registers
  kFp8Alu,         // the FP8 consumer's ALU work of a tile: O = alpha O + Otmp, then the softmax
  kFp8Consumer,    // the FP8 consumer's tile loop (GEMM phase in the ping-pong turn, O update,
                   // softmax) on resident tiles; both consumers run it
  kFp8ConsumerFree,  // the same without the turn (consumers unordered)
  kF16Phase,       // the NVFP4 kernel's GEMM phase: PV 8 x m64n128k16 RS, QK^T 8 x SS, f16
  kF16QK,          // its QK^T alone (SS)
  kF16PV,          // its PV alone (RS)
  kNvfp4Alu,       // the NVFP4 consumer's ALU work of a tile: delta loads, softmax + P
                   // quantisation (nvfp4_softmax_tile), O rescale
  kNvfp4Consumer,  // the NVFP4 consumer's tile loop (no delta warps: delta read as it lies)
  // Calibration: 64 independent instructions of one pipe per iteration (cycles per 64 = the
  // pipe's rate for this many warps per SM sub-partition).
  kCalFfma,   // FFMA (FMA pipe)
  kCalFmnmx,  // FMNMX (ALU pipe)
  kCalMufu,   // MUFU.EX2 (XU)
};

template <class T, int N>
__device__ __forceinline__ void zero(T (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = T(0);
}

// The delta as the initial scores, loaded anew each iteration as in the kernel (where the loads
// follow the delta_full wait): from one of two buffers by the iteration's parity, since ptxas
// hoists loads of one never-written buffer out of the loop, and its 64 values then spill.
__device__ __forceinline__ void delta_as_scores_of_iteration(float (&s)[64], const Operands& op, int it,
                                                             int quad_col) {
  sm90::delta_as_scores(s, op.delta[it & 1], quad_col);
}

// The NVFP4 consumer's ALU work after its GEMMs (nvfp4_kernel.cuh after_gemms, production
// variant, without the barrier arrivals).
__device__ __forceinline__ void nvfp4_alu(float (&s)[64], float (&o)[64], uint32_t (&pa)[32], sm90::Nvfp4RowState& st,
                                          const Operands& op) {
  sm90::nvfp4_softmax_tile</*kQuantizeP=*/true, /*kFastRounding=*/true, /*kFoldIn=*/true,
                           /*kF16Rounding=*/true>(s, pa, st, kNvfp4C, op.recip, op.p_fold);
  sm90::rescale_o(o, st);
}

// Runs `iters` iterations of role R as consumer `consumer` (0: warpgroup 1, 1: warpgroup 2) and
// returns the cycles they took. Every register array is fenced at the end, so no work is dead.
template <int R, int consumer>
__device__ long long run_role(const Operands& op, int iters, float* sink_out) {
  const int lane = threadIdx.x % 32;
  const int quad_col = 2 * (lane % 4);
  const uint8_t* fp8_q_rows = op.fp8_q + 64 * consumer * sm90::kHeadDim;
  const uint64_t f16_q_desc = ptx::wgmma_desc_sw128(op.f16_q[0] + 64 * consumer * 128);
  float s[64], otmp[64], o[64];
  uint32_t pa16[16], pa32[32];
  zero(s);
  zero(otmp);
  zero(o);
#pragma unroll
  for (int i = 0; i < 16; ++i) pa16[i] = 0x3A3A3A3Au;  // E4M3 0.8125 x 4
#pragma unroll
  for (int i = 0; i < 32; ++i) pa32[i] = 0x38003800u;  // f16 0.5 x 2
  // Scores with a spread, for the ALU roles that start from registers.
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = static_cast<float>((i * 37 + lane * 11) % 29) - 14.0f;
  sm90::Fp8RowState st8;
  st8.reset(1.0f, 1.0f);
  sm90::Nvfp4RowState st4;
  st4.reset();
  const sm90::PingPong<R == kFp8Consumer || R == kNvfp4Consumer> turn(consumer);
  turn.start();

  // The GEMM-only roles overwrite their accumulator every iteration; one element of each result
  // added here keeps every wgmma's result read (ptxas empties wgmmas whose results nothing reads).
  float live = 0.0f;
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    if constexpr (R == kFp8QK) {
      sm90::issue_qk(s, fp8_q_rows, op.fp8_k);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      live += s[0];
    } else if constexpr (R == kFp8PV) {
      sm90::issue_pv(otmp, pa16, op.fp8_v);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(otmp);
      live += otmp[0];
    } else if constexpr (R == kFp8Phase) {
      sm90::issue_pv(otmp, pa16, op.fp8_v);
      sm90::issue_qk(s, fp8_q_rows, op.fp8_k);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      ptx::fence_operands(otmp);
      live += s[0] + otmp[0];
    } else if constexpr (R == kFp8Softmax) {
      sm90::fp8_softmax_tile<false, 32>(s, pa16, st8, sm90::kTileKeys, kFp8Sk, kC, quad_col);
      ptx::fence_operands(pa16);
    } else if constexpr (R == kFp8Alu) {
      ptx::fence_operands(otmp);  // a fresh Otmp every tile, as from the PV
      sm90::update_o(o, otmp, st8.alpha);
      sm90::fp8_softmax_tile<false, 32>(s, pa16, st8, sm90::kTileKeys, kFp8Sk, kC, quad_col);
      ptx::fence_operands(pa16);
    } else if constexpr (R == kFp8Consumer || R == kFp8ConsumerFree) {
      turn.wait();
      sm90::issue_pv(otmp, pa16, op.fp8_v);
      sm90::issue_qk(s, fp8_q_rows, op.fp8_k);
      turn.pass();
      ptx::wgmma_wait<1>();
      ptx::fence_operands(otmp);
      ptx::fence_operands(pa16);
      sm90::update_o(o, otmp, st8.alpha);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      sm90::fp8_softmax_tile<false, 32>(s, pa16, st8, sm90::kTileKeys, kFp8Sk, kC, quad_col);
    } else if constexpr (R == kF16QK) {
      sm90::issue_qk(s, f16_q_desc, op.f16_k[0]);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      live += s[0];
    } else if constexpr (R == kF16PV) {
      sm90::issue_pv(o, pa32, op.f16_v[0]);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(o);
      live += o[0];
    } else if constexpr (R == kF16Phase) {
      sm90::issue_pv(o, pa32, op.f16_v[0]);
      sm90::issue_qk(s, f16_q_desc, op.f16_k[0]);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      ptx::fence_operands(o);
    } else if constexpr (R == kCalFfma) {
#pragma unroll
      for (int i = 0; i < 64; ++i) s[i] = fmaf(s[i], 0.999f, 0.001f);
    } else if constexpr (R == kCalFmnmx) {
      const float t = static_cast<float>(it & 15);
#pragma unroll
      for (int i = 0; i < 64; ++i) s[i] = fmaxf(s[i], t);
    } else if constexpr (R == kCalMufu) {
#pragma unroll
      for (int i = 0; i < 64; ++i) s[i] = ptx::ex2_approx(-fabsf(s[i]));
    } else if constexpr (R == kNvfp4Alu) {
      delta_as_scores_of_iteration(s, op, it, quad_col);
      nvfp4_alu(s, o, pa32, st4, op);
      ptx::fence_operands(pa32);
    } else if constexpr (R == kNvfp4Consumer) {
      delta_as_scores_of_iteration(s, op, it, quad_col);
      turn.wait();
      sm90::issue_pv(o, pa32, op.f16_v[0]);
      sm90::issue_qk(s, f16_q_desc, op.f16_k[0]);
      turn.pass();
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      ptx::fence_operands(o);
      ptx::fence_operands(pa32);
      nvfp4_alu(s, o, pa32, st4, op);
    }
  }
  const long long t1 = clock64();
  turn.finish();
  // Every result feeds a store that never happens but that the compiler cannot rule out: ptxas
  // turns wgmmas whose accumulators nothing reads into empty ones.
  float sink = live + st8.l[0] + st8.l[1] + st4.l[0] + st4.l[1];
#pragma unroll
  for (int i = 0; i < 64; ++i) sink += s[i] + otmp[i] + o[i];
#pragma unroll
  for (int i = 0; i < 16; ++i) sink += __uint_as_float(pa16[i] & 0x3FFFFFFFu);
#pragma unroll
  for (int i = 0; i < 32; ++i) sink += __uint_as_float(pa32[i] & 0x3FFFFFFFu);
  if (sink == 1234.5f) *sink_out = sink;
  return t1 - t0;
}

constexpr int kBackgroundFactor = 4;

// out[(SM * kOutSlots + consumer) * 2 + {0, 1}] = cycles, iterations of each consumer warpgroup
// (iterations 0: idle); sink: written only if the results sum to a value they never do.
constexpr int kOutSlots = kLoopMaxConsumers;
template <int kRole1, int kRole2, bool kRole2Measured>
__global__ void __launch_bounds__(sm90::kThreads, 1) pipes_kernel(long long* out, float* sink, int iters) {
  extern __shared__ uint8_t dynamic_smem[];
  Operands& op = *reinterpret_cast<Operands*>((reinterpret_cast<uintptr_t>(dynamic_smem) + 1023) & ~uintptr_t{1023});
  fill_operands(op);
  ptx::fence_proxy_async_shared();  // the generic-proxy writes above, before wgmma reads them
  __syncthreads();
  const int warpgroup = threadIdx.x / sm90::kWarpgroupThreads;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<sm90::kProducerRegs>();
    return;
  }
  ptx::setmaxnreg_inc<sm90::kConsumerRegs>();
  long long cycles = 0;
  int n = iters;
  if (warpgroup == 1) {
    if constexpr (kRole1 != kIdle) cycles = run_role<kRole1, 0>(op, n, sink);
  } else {
    n = kRole2Measured ? iters : kBackgroundFactor * iters;
    if constexpr (kRole2 != kIdle) cycles = run_role<kRole2, 1>(op, n, sink);
  }
  if (threadIdx.x % sm90::kWarpgroupThreads == 0) {
    long long* slot = out + (blockIdx.x * kOutSlots + (warpgroup - 1)) * 2;
    slot[0] = cycles;
    slot[1] = n;
  }
}

// ---- the consumer tile loop for 2 or 3 consumers, 128- or 64-key tiles --------------------------
//
// One code copy for all consumers (the consumer index is a runtime value, as in nvfp4_kernel.cuh,
// where two copies thrashed the instruction cache), K and V^T tiles and the delta resident, no
// delta warps. A tile of kKeys keys: S = delta + Q' K'^T (kKeys / 2 accumulator registers), the
// kernel's softmax + P quantisation on them (nvfp4_softmax_tile: a 64-key tile is one window, one
// P group a row), O = alpha O + P V (O 64 registers, P kKeys / 4 f16x2 A registers). The GEMM
// phase issues PV of the previous tile, then QK^T of this one, as the kernel does.

enum LoopRole : int {
  kLoopTurn,  // the tile loop, GEMM phases in a round-robin turn of the consumers
  kLoopFree,  // the same, consumers unordered
  kLoopGemm,  // the GEMM phase alone: PV + QK^T, wait (no delta, no softmax)
  kLoopAlu,   // the ALU work alone: delta, softmax + P quantisation, O rescale
};

// The register split: launch gives 65,536 / threads a thread (168 for 384, 128 for 512);
// warpgroup 0 only idles. Two consumers: the split of the NVFP4 kernel's three-warpgroup
// delta_mma_sync build (96 / 200; production has four warpgroups, 40 / 40 / 216). Three: 32 / 160,
// which uses all 65,536 (setmaxnreg takes multiples of 8; 24 for the idle warpgroup would leave
// the consumers at 160 all the same).
template <int kConsumersN>
struct LoopRegs;
template <>
struct LoopRegs<2> {
  static constexpr uint32_t kIdle = sm90::kNvfp4ProducerRegs, kConsumer = sm90::kNvfp4ConsumerRegs;
};
template <>
struct LoopRegs<3> {
  static constexpr uint32_t kIdle = 32, kConsumer = 160;
};
template <int kConsumersN>
constexpr int loop_threads() {
  return (1 + kConsumersN) * sm90::kWarpgroupThreads;
}
// Whether the split fits what the launch allocates: ptxas caps a kernel under
// __launch_bounds__(threads, 1) at 65,536 / threads registers a thread, rounded down to 8.
template <int kConsumersN>
constexpr bool loop_regs_fit() {
  constexpr uint32_t at_launch = 65536 / loop_threads<kConsumersN>() / 8 * 8;
  return (LoopRegs<kConsumersN>::kIdle + kConsumersN * LoopRegs<kConsumersN>::kConsumer) * sm90::kWarpgroupThreads <=
         at_launch * loop_threads<kConsumersN>();
}
static_assert(loop_regs_fit<2>() && loop_regs_fit<3>(), "the consumers' registers must come from warpgroup 0's");

// The turn of kConsumersN consumers (generalises sm90::PingPong, which is this for 2): consumer c
// waits on barrier kTurn + c and, once its GEMMs are issued, arrives on kTurn + (c + 1) % N.
// Consumer 0 goes first: the last consumer arrives once on kTurn at the start, and consumer 0
// takes that extra turn at the end, so every barrier ends balanced (kTurn + c: one arrival of
// consumer c - 1 per sync of consumer c). Each barrier has at most one phase in flight: the
// arrival of round k + 1 on kTurn + c needs the turn to have passed through c in round k.
template <int kConsumersN, bool kEnabled>
struct RoundRobin {
  static_assert(sm90::kTurn + kConsumersN <= 16, "named barriers 1..15");
  uint32_t mine, next;
  __device__ __forceinline__ explicit RoundRobin(int consumer)
      : mine(sm90::kTurn + static_cast<uint32_t>(consumer)),
        next(sm90::kTurn + static_cast<uint32_t>(consumer + 1 == kConsumersN ? 0 : consumer + 1)) {}
  __device__ __forceinline__ void start() const {
    if constexpr (kEnabled) {
      if (next == sm90::kTurn) ptx::named_barrier_arrive(next, sm90::kPingPongThreads);
    }
  }
  __device__ __forceinline__ void wait() const {
    if constexpr (kEnabled) ptx::named_barrier_sync(mine, sm90::kPingPongThreads);
  }
  __device__ __forceinline__ void pass() const {
    if constexpr (kEnabled) ptx::named_barrier_arrive(next, sm90::kPingPongThreads);
  }
  __device__ __forceinline__ void finish() const {
    if constexpr (kEnabled) {
      if (mine == sm90::kTurn) ptx::named_barrier_sync(mine, sm90::kPingPongThreads);
    }
  }
};

// Descriptor offset (>> 4) of k16 step k in a tile of two atoms `atom_bytes` apart (Q: the loop's
// 192-row atoms; K and V^T: 128-row ones, as sm90::k16_step_offset).
__host__ __device__ constexpr uint32_t k16_offset(int k, int atom_bytes) {
  return static_cast<uint32_t>((k / 4) * atom_bytes + 32 * (k % 4)) >> 4;
}

// S = delta + Q' K'^T over the 128 channels: 8 k16 steps of m64n128k16 (128 keys) or m64n64k16
// (64 keys: rows 0..63 of the K tile), one commit. Descriptors are low words plus constant offsets
// (ptx::wgmma_desc_from_low: 32-bit adds, as in the FP8 kernel); the consumer's Q rows are a
// runtime offset, so ptxas builds the Q descriptors in registers (an IADD3 and two R2UR a step).
template <int kKeys>
__device__ __forceinline__ void loop_issue_qk(float (&s)[kKeys / 2], uint32_t q_desc, uint32_t k_desc) {
  ptx::wgmma_fence();  // the delta was just written into s
#pragma unroll
  for (int k = 0; k < sm90::kHeadDim / 16; ++k) {
    const uint64_t a = ptx::wgmma_desc_from_low(q_desc + k16_offset(k, kLoopQAtomBytes));
    const uint64_t b = ptx::wgmma_desc_from_low(k_desc + k16_offset(k, sm90::kFp16AtomBytes));
    if constexpr (kKeys == 128) {
      ptx::wgmma_m64n128k16_f16_ss(s, a, b, 1u);
    } else {
      ptx::wgmma_m64n64k16_f16_ss(s, a, b, 1u);
    }
  }
  ptx::wgmma_commit();
}

// O += P V over the tile's keys: kKeys / 16 k16 steps of m64n128k16 RS (V^T atom 0 holds keys
// 0..63, so a 64-key tile's steps stay in it), one commit.
template <int kKeys>
__device__ __forceinline__ void loop_issue_pv(float (&o)[64], const uint32_t (&pa)[kKeys / 4], uint32_t v_desc) {
  ptx::wgmma_fence();  // the softmax wrote pa and the rescale o
#pragma unroll
  for (int k = 0; k < kKeys / 16; ++k) {
    const uint32_t a[4] = {pa[4 * k], pa[4 * k + 1], pa[4 * k + 2], pa[4 * k + 3]};
    ptx::wgmma_m64n128k16_f16_rs(o, a, ptx::wgmma_desc_from_low(v_desc + k16_offset(k, sm90::kFp16AtomBytes)), 1u);
  }
  ptx::wgmma_commit();
}

// The tile's delta as the initial scores, s[4i + 2r + e] = delta[8i + 2t + e] (sm90::delta_as_scores
// for any tile width), from one of two buffers by the iteration's parity (see
// delta_as_scores_of_iteration).
template <int kKeys>
__device__ __forceinline__ void loop_delta(float (&s)[kKeys / 2], const Operands& op, int it, int quad_col) {
  const float2* d = fh3::opaque_pointer(reinterpret_cast<const float2*>(op.delta[it & 1] + quad_col));
#pragma unroll
  for (int i = 0; i < kKeys / 8; ++i) {
    const float2 v = d[4 * i];
    s[4 * i] = s[4 * i + 2] = v.x;
    s[4 * i + 1] = s[4 * i + 3] = v.y;
  }
}

template <int kConsumersN, int kKeys, int kRole>
__device__ long long run_loop(const Operands& op, int consumer, int iters, float* sink_out) {
  static_assert(kKeys == 128 || kKeys == 64, "128- or 64-key tiles");
  const int lane = threadIdx.x % 32;
  const int quad_col = 2 * (lane % 4);
  const uint32_t q_desc = ptx::wgmma_desc_sw128_low(op.f16_q_loop[0] + 64 * consumer * 128);
  const uint32_t k_desc = ptx::wgmma_desc_sw128_low(op.f16_k[0]);
  const uint32_t v_desc = ptx::wgmma_desc_sw128_low(op.f16_v[0]);
  float s[kKeys / 2], o[64];
  uint32_t pa[kKeys / 4];
  zero(o);
#pragma unroll
  for (int i = 0; i < kKeys / 4; ++i) pa[i] = 0x38003800u;  // f16 0.5 x 2: the first PV's P
#pragma unroll
  for (int i = 0; i < kKeys / 2; ++i) s[i] = 0.0f;
  sm90::Nvfp4RowState st;
  st.reset();
  const RoundRobin<kConsumersN, kRole == kLoopTurn> turn(consumer);
  turn.start();

  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    if constexpr (kRole == kLoopTurn || kRole == kLoopFree) {
      loop_delta<kKeys>(s, op, it, quad_col);
      // Needed for asynchronous wgmmas, found by ptxas' report rather than reasoned: without this
      // fence on the delta-initialised scores, ptxas serialises every wgmma of these loops (C7518,
      // "compiler-inserted WG.DP in divergent path"). The "ping-pong" row above has none, and
      // ptxas makes its consumer 1 wait for the PV before it issues the QK^T (C7517).
      ptx::fence_operands(s);
      turn.wait();
      loop_issue_pv<kKeys>(o, pa, v_desc);
      loop_issue_qk<kKeys>(s, q_desc, k_desc);
      turn.pass();
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      ptx::fence_operands(o);
      ptx::fence_operands(pa);
      sm90::nvfp4_softmax_tile</*kQuantizeP=*/true, /*kFastRounding=*/true, /*kFoldIn=*/true,
                               /*kF16Rounding=*/true>(s, pa, st, kNvfp4C, op.recip, op.p_fold);
      sm90::rescale_o(o, st);
    } else if constexpr (kRole == kLoopGemm) {
      loop_issue_pv<kKeys>(o, pa, v_desc);
      loop_issue_qk<kKeys>(s, q_desc, k_desc);
      ptx::wgmma_wait<0>();
      ptx::fence_operands(s);
      ptx::fence_operands(o);
    } else {
      static_assert(kRole == kLoopAlu, "a LoopRole");
      loop_delta<kKeys>(s, op, it, quad_col);
      sm90::nvfp4_softmax_tile</*kQuantizeP=*/true, /*kFastRounding=*/true, /*kFoldIn=*/true,
                               /*kF16Rounding=*/true>(s, pa, st, kNvfp4C, op.recip, op.p_fold);
      sm90::rescale_o(o, st);
      ptx::fence_operands(pa);
      ptx::fence_operands(o);
    }
  }
  const long long t1 = clock64();
  turn.finish();
  float sink = st.l[0] + st.l[1];
#pragma unroll
  for (int i = 0; i < kKeys / 2; ++i) sink += s[i];
#pragma unroll
  for (int i = 0; i < 64; ++i) sink += o[i];
#pragma unroll
  for (int i = 0; i < kKeys / 4; ++i) sink += __uint_as_float(pa[i] & 0x3FFFFFFFu);
  if (sink == 1234.5f) *sink_out = sink;
  return t1 - t0;
}

// kConsumersN consumer warpgroups after the idle warpgroup 0; the first kActive run `kRole`, the
// others idle (the turn needs them all).
template <int kConsumersN, int kActive, int kKeys, int kRole>
__global__ void __launch_bounds__(loop_threads<kConsumersN>(), 1) loop_kernel(long long* out, float* sink, int iters) {
  static_assert(kConsumersN <= kOutSlots && kActive >= 1 && kActive <= kConsumersN, "consumers");
  static_assert(kRole != kLoopTurn || kActive == kConsumersN, "every consumer takes its turn");
  extern __shared__ uint8_t dynamic_smem[];
  Operands& op = *reinterpret_cast<Operands*>((reinterpret_cast<uintptr_t>(dynamic_smem) + 1023) & ~uintptr_t{1023});
  fill_operands(op);
  ptx::fence_proxy_async_shared();  // the generic-proxy writes above, before wgmma reads them
  __syncthreads();
  const int warpgroup = threadIdx.x / sm90::kWarpgroupThreads;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<LoopRegs<kConsumersN>::kIdle>();
    return;
  }
  ptx::setmaxnreg_inc<LoopRegs<kConsumersN>::kConsumer>();
  const int consumer = warpgroup - 1;
  long long cycles = 0;
  const bool active = consumer < kActive;
  if (active) cycles = run_loop<kConsumersN, kKeys, kRole>(op, consumer, iters, sink);
  if (threadIdx.x % sm90::kWarpgroupThreads == 0) {
    long long* slot = out + (blockIdx.x * kOutSlots + consumer) * 2;
    slot[0] = cycles;
    slot[1] = active ? iters : 0;
  }
}

// ---- host ------------------------------------------------------------------------------------

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "sm90_pipes: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Experiment {
  const char* name;
  void (*kernel)(long long*, float*, int);
  int threads;
  int iters;
  int row_keys;        // query rows x keys a consumer handles per iteration (0: not a tile loop)
  const char* expect;  // what the numbers are compared with
};

template <int kRole1, int kRole2, bool kRole2Measured = false>
Experiment experiment(const char* name, int iters, const char* expect, int row_keys = 0) {
  return {name, pipes_kernel<kRole1, kRole2, kRole2Measured>, sm90::kThreads, iters, row_keys, expect};
}

template <int kConsumersN, int kActive, int kKeys, int kRole>
Experiment loop_experiment(const char* name, int iters, const char* expect) {
  return {name, loop_kernel<kConsumersN, kActive, kKeys, kRole>, loop_threads<kConsumersN>(), iters, 64 * kKeys,
          expect};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  int device = 0, sms = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "device properties");
  if (prop.major != 9) {
    std::fprintf(stderr, "sm90_pipes: needs a Hopper GPU (sm_90), got %s (sm_%d%d)\n", prop.name, prop.major,
                 prop.minor);
    return 1;
  }
  const std::vector<Experiment> experiments = {
      experiment<kCalFfma, kIdle>("calibration: 64 FFMA, one warp per SMSP", 4000, "64 at one a cycle"),
      experiment<kCalFfma, kCalFfma, true>("calibration: 64 FFMA, two warps per SMSP", 4000, "128"),
      experiment<kCalFmnmx, kIdle>("calibration: 64 FMNMX, one warp per SMSP", 4000, "128 at one per 2 cycles"),
      experiment<kCalMufu, kIdle>("calibration: 64 MUFU.EX2, one warp per SMSP", 4000, "512 at 4 lanes a cycle"),
      experiment<kFp8QK, kIdle>("fp8 QK^T (4 x m64n128k32 SS)", 4000, "256 = 4 x 64 at the FP8 peak"),
      experiment<kFp8PV, kIdle>("fp8 PV (4 x m64n128k32 RS)", 4000, "256"),
      experiment<kFp8Phase, kIdle>("fp8 GEMM phase (PV + QK^T)", 2000, "512"),
      experiment<kFp8Phase, kFp8Phase, true>("fp8 GEMM phase, both consumers", 2000, "1,024: one tensor pipe"),
      experiment<kFp8Softmax, kIdle>("fp8 softmax step", 2000, "~500: 62 MUFU x 8 cycles"),
      experiment<kFp8Alu, kIdle>("fp8 consumer ALU (O update + softmax)", 2000, "~550"),
      experiment<kFp8Alu, kFp8Alu, true>("fp8 consumer ALU, both consumers", 2000, "~1,000: 2 x 62 MUFU x 8"),
      experiment<kFp8Alu, kFp8Phase>("fp8 consumer ALU beside the other's GEMM phases", 2000,
                                     "as alone, unless the GEMMs slow its issue"),
      experiment<kFp8Alu, kFp8QK>("fp8 consumer ALU beside the other's QK^T only (SS)", 2000,
                                  "the accumulator traffic alone"),
      experiment<kFp8Alu, kFp8PV>("fp8 consumer ALU beside the other's PV only (RS)", 2000,
                                  "plus A read from registers"),
      experiment<kFp8Consumer, kFp8Consumer, true>("fp8 consumer loop, ping-pong", 2000,
                                                   "the kernel's period without tiles; 2,475 in the kernel"),
      experiment<kFp8ConsumerFree, kFp8ConsumerFree, true>("fp8 consumer loop, unordered", 2000, ""),
      experiment<kF16Phase, kIdle>("f16 GEMM phase (PV + QK^T, 16 x m64n128k16)", 1000, "1,024 at the FP16 peak"),
      experiment<kF16Phase, kF16Phase, true>("f16 GEMM phase, both consumers", 1000, "2,048"),
      experiment<kNvfp4Alu, kIdle>("nvfp4 consumer ALU (delta, softmax + P quantisation, rescale)", 1000, ""),
      experiment<kNvfp4Alu, kNvfp4Alu, true>("nvfp4 consumer ALU, both consumers", 1000, ""),
      experiment<kNvfp4Alu, kF16Phase>("nvfp4 consumer ALU beside the other's GEMM phases", 1000, ""),
      experiment<kNvfp4Alu, kF16QK>("nvfp4 consumer ALU beside the other's QK^T only (SS)", 1000, ""),
      experiment<kNvfp4Alu, kF16PV>("nvfp4 consumer ALU beside the other's PV only (RS)", 1000, ""),
      experiment<kNvfp4Consumer, kNvfp4Consumer, true>("nvfp4 consumer loop, ping-pong (no delta warps)", 1000,
                                                       "~3,600 in the kernel", 64 * sm90::kTileKeys),
      // The consumer tile loop as 2 or 3 consumers of one code copy (run_loop): (a) today's
      // schedule, the same loop as the row above but for the pinned delta copies and the runtime
      // consumer index; (b) three consumers on 64-key tiles. Their GEMM phases and ALU work
      // alone first (row-keys per cycle: each part's own ceiling).
      loop_experiment<2, 1, 128, kLoopGemm>("nvfp4 loop 2x128: GEMM phase alone (PV 8 RS + QK^T 8 SS)", 1000,
                                            "1,024 at the FP16 peak"),
      loop_experiment<2, 1, 128, kLoopAlu>("nvfp4 loop 2x128: ALU alone (delta, softmax + P, rescale)", 1000,
                                           "~1,360 (third session)"),
      loop_experiment<2, 2, 128, kLoopTurn>("nvfp4 loop 2x128, ping-pong (a)", 1000, "~3,640: 4.5 row-keys/cycle"),
      loop_experiment<2, 2, 128, kLoopFree>("nvfp4 loop 2x128, unordered", 1000, ""),
      loop_experiment<3, 1, 64, kLoopGemm>("nvfp4 loop 3x64: GEMM phase alone (PV 4 RS + QK^T 8 SS n64)", 1000,
                                           "512 at the FP16 peak"),
      loop_experiment<3, 3, 64, kLoopGemm>("nvfp4 loop 3x64: GEMM phases of all three at once", 1000,
                                           "1,536: one tensor pipe"),
      loop_experiment<3, 1, 64, kLoopAlu>("nvfp4 loop 3x64: ALU alone (64 keys)", 1000, ""),
      loop_experiment<3, 3, 64, kLoopAlu>("nvfp4 loop 3x64: ALU of all three at once", 1000, ""),
      loop_experiment<3, 3, 64, kLoopTurn>("nvfp4 loop 3x64, round-robin (b)", 1000,
                                           "predicted 2,300-2,600: 4.7-5.3 row-keys/cycle"),
      loop_experiment<3, 3, 64, kLoopFree>("nvfp4 loop 3x64, unordered", 1000, ""),
#ifdef SM90_PIPES_LOOP_3X128
      // (c) Three consumers on 128-key tiles: S, O and P alone are 160 registers, all that 160 a
      // thread allows, so ptxas spills; built only with -DSM90_PIPES_LOOP_3X128, for its report.
      loop_experiment<3, 3, 128, kLoopTurn>("nvfp4 loop 3x128, round-robin (c; spills)", 1000, ""),
#endif
  };
  long long* out = nullptr;
  float* sink = nullptr;
  check(cudaMalloc(&out, sizeof(long long) * 2 * kOutSlots * sms), "cudaMalloc");
  check(cudaMalloc(&sink, sizeof(float)), "cudaMalloc");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  std::string json = "[";
  std::printf("%s, %d SMs; cycles per iteration (median over SMs) of consumer warpgroups 1-3; rk/cyc: query-row x key\n"
              "pairs per SM cycle, summed over the consumers (FP16 tensor peak: 8)\n",
              prop.name, sms);
  std::printf("%-64s %10s %10s %10s %8s %7s  %s\n", "experiment", "wg1", "wg2", "wg3", "MHz", "rk/cyc",
              "compare with");
  for (const Experiment& e : experiments) {
    check(cudaFuncSetAttribute(e.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)),
          "shared-memory opt-in");
    // Slots of consumers the kernel does not have stay zero (skipped below).
    check(cudaMemset(out, 0, sizeof(long long) * 2 * kOutSlots * sms), "cudaMemset");
    e.kernel<<<sms, e.threads, kSmemBytes>>>(out, sink, e.iters / 10);  // warm-up
    check(cudaGetLastError(), "launch");
    check(cudaEventRecord(start), "event");
    e.kernel<<<sms, e.threads, kSmemBytes>>>(out, sink, e.iters);
    check(cudaGetLastError(), "launch");
    check(cudaEventRecord(stop), "event");
    check(cudaEventSynchronize(stop), e.name);
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, start, stop), "event time");
    std::vector<long long> host(2 * kOutSlots * sms);
    check(cudaMemcpy(host.data(), out, sizeof(long long) * host.size(), cudaMemcpyDeviceToHost), "copy");
    // rate: per SM, the sum over its timed consumers of row_keys / (cycles per iteration): the
    // row-keys the SM completes per cycle while they all run (a background warpgroup's share is
    // left out: it runs another role).
    std::vector<double> per[kOutSlots], total, rate;
    for (int sm = 0; sm < sms; ++sm) {
      double sm_rate = 0.0;
      for (int c = 0; c < kOutSlots; ++c) {
        const long long cycles = host[(sm * kOutSlots + c) * 2], n = host[(sm * kOutSlots + c) * 2 + 1];
        if (cycles > 0 && n > 0) per[c].push_back(static_cast<double>(cycles) / n);
        if (cycles > 0) total.push_back(static_cast<double>(cycles));
        if (cycles > 0 && n == e.iters) sm_rate += static_cast<double>(e.row_keys) * n / cycles;
      }
      rate.push_back(sm_rate);
    }
    const double wg1 = median(per[0]), wg2 = median(per[1]), wg3 = median(per[2]);
    const double row_keys_per_cycle = e.row_keys > 0 ? median(rate) : 0.0;
    // The longest warpgroup's cycles over the kernel's time: the SM clock it ran at (a lower
    // bound: the launch and the operand fill are in the time too).
    const double mhz = total.empty() ? 0.0 : *std::max_element(total.begin(), total.end()) / (ms * 1e3);
    std::printf("%-64s %10.1f %10.1f %10.1f %8.0f %7.2f  %s\n", e.name, wg1, wg2, wg3, mhz, row_keys_per_cycle,
                e.expect);
    char row[512];
    std::snprintf(row, sizeof(row),
                  "%s{\"experiment\": \"%s\", \"wg1\": %.1f, \"wg2\": %.1f, \"wg3\": %.1f, \"mhz\": %.0f, "
                  "\"row_keys_per_cycle\": %.3f}",
                  json.size() > 1 ? ", " : "", e.name, wg1, wg2, wg3, mhz, row_keys_per_cycle);
    json += row;
  }
  json += "]\n";
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "sm90_pipes: cannot write %s\n", json_path);
      return 1;
    }
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  check(cudaFree(out), "cudaFree");
  check(cudaFree(sink), "cudaFree");
  return 0;
}
