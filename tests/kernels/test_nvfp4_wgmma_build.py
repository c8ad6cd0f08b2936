"""CPU checks of the Hopper NVFP4 kernel (module ``nvfp4_wgmma``, sm_90a) and of its software
E2M1 rounding.

Built through the JIT (no GPU needed; nvcc and cuobjdump are), read back from the binary:

- both products on FP16 wgmma, ``HGMMA.64x128x16.F32`` (FP16 inputs: not ``.BF16``): 8 with both
  operands in shared memory (QK^T, 8 k16 steps) and 8 with A = P from registers (PV), each twice
  (first/last phase and the loop; both consumers run one copy), and the delta warpgroup's 16
  ``HGMMA.64x8x16.F32`` on shared memory, no mma.sync;
- no local memory at all (no stack, no spills, no LDL/STL), the roles' register split,
  512 threads, the shared memory within Hopper's 227 KB;
- the delta loads on immediate offsets, and no wgmma serialised;
- the benchmark builds: the delta forms, ``poly_exp2_every`` (exponentials off MUFU), the
  background traffic; the flags of the builds measured and removed are refused;
- the module's pre-pass is the FP16 one (quantize_nvfp4_fp16: its two tile kernels and its
  reduce, no local memory, 2 CTAs an SM), with no codes pre-pass and no expansion kernels.

The P quantisation's rounding (numerics/e2m1_round.cuh) is compiled as host C++ and checked on
every non-negative float bit pattern (2^31 of them: zero, subnormals, normals, inf, NaN) against
an independent search of the E2M1 grid (its unsaturated fast path on every float below 7), and
on the ties and a random sample against formats.py's ``rn_e2m1``; its f16x2 forms (the
production kernel's) on every non-negative FP16 pattern in both halves.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import binary_tools as bt
import pytest

pytestmark = pytest.mark.nvcc

KERNEL = "attention_nvfp4_wgmma_kernel"
HGMMA = "HGMMA.64x128x16.F32"
MAX_SMEM = 227 * 1024


@pytest.fixture(scope="module")
def so() -> Path:
    from flashinfer_h3.jit import KernelConfig, build_module

    return Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a")))


def test_both_products_on_fp16_wgmma(so: Path) -> None:
    sass = bt.sass(so, KERNEL)
    lines = sass.splitlines()
    ss = [x for x in lines if re.search(re.escape(HGMMA) + r" R\d+, gdesc", x)]
    rs = [x for x in lines if re.search(re.escape(HGMMA) + r" R\d+, R\d+, gdesc", x)]
    print(f"{KERNEL}: {len(ss)} SS (QK^T) and {len(rs)} RS (PV) FP16 wgmma")
    # One consumer code path (the warpgroup index is a runtime value): QK^T in the first phase and
    # the loop, PV in the loop and the last phase, 8 k16 steps each.
    assert len(ss) == 2 * 8 and len(rs) == 2 * 8
    assert ".BF16" not in "".join(x for x in lines if "HGMMA" in x), "FP16, not BF16, operands"
    assert "QGMMA" not in sass
    # The delta warpgroup: two m64 blocks x 8 k16 steps, A (the K tile) and B (qbar's rows) in
    # shared memory, so no ldmatrix anywhere and no mma.sync.
    assert len(re.findall(r"HGMMA\.64x8x16\.F32 R\d+, gdesc", sass)) == 16
    assert not re.search(r"HGMMA\.64x8x16\.F32 R\d+, R\d+", sass)
    assert "HMMA.16816" not in sass and "LDSM" not in sass
    assert "USETMAXREG" in sass


def test_roles_register_split() -> None:
    """Four warpgroups of 128 registers a thread at launch (512 threads: the whole register
    file; a CTA that started with fewer would spin in the consumers' increase): the TMA and
    delta warpgroups drop to 40, the consumers rise to 216; the ``wide_consumers=False`` build
    splits 40 / 72 / 200 (as the RS delta build must), without spills; the ``delta_mma_sync``
    build's three warpgroups start at 168 and split 96 / 200."""
    from flashinfer_h3.jit import KernelConfig, build_module

    production = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a")))
    sass = bt.sass(production, KERNEL)
    assert bt.resources(production, KERNEL)["REG"] == 128
    assert len(re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x28\b", sass)) == 2
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xd8\b", sass)
    narrow = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a",
                                            flags={"wide_consumers": False})))
    sass = bt.sass(narrow, KERNEL)
    for regs in (0x28, 0x48):
        assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {regs:#x}\b", sass), hex(regs)
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xc8\b", sass)
    bt.assert_no_local_memory(narrow, KERNEL)
    config = KernelConfig("nvfp4_wgmma", arch="sm_90a", flags={"delta_mma_sync": True})
    mma_sync = Path(build_module(config))
    sass = bt.sass(mma_sync, KERNEL)
    assert bt.resources(mma_sync, KERNEL)["REG"] == 168
    assert re.search(r"USETMAXREG\.DEALLOC\.CTAPOOL 0x60\b", sass)
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xc8\b", sass)


def test_no_local_memory(so: Path) -> None:
    bt.assert_no_local_memory(so, KERNEL)
    smem = int(bt.load(so).attention_nvfp4_wgmma_smem_bytes())
    assert 0 < smem <= MAX_SMEM


def test_epilogue_divides_each_element_and_nothing_is_prefetched(so: Path) -> None:
    """The epilogue is bf16_rn(O / l) through one div.rn an output (a thread's 64: one range
    check ``FCHK`` each; one reciprocal a row measured slower here, nvfp4_kernel.cuh
    store_item_output), and the kernel issues no L2 prefetch of its own (``UBLKPF`` / ``UTMAPF``:
    the removed prefetch builds' forms read more than they named)."""
    sass = bt.sass(so, KERNEL)
    assert sass.count("FCHK") == 64
    assert "UBLKPF" not in sass and "UTMAPF" not in sass


def test_delta_loads_take_offsets_and_wgmma_asynchronous(so: Path) -> None:
    """The consumers load a K tile's delta as the initial scores with 16 8-byte loads from one
    base and immediate offsets (common.cuh opaque_pointer; with the buffer's alignment known, the
    compiler built every address with an OR and a move of its own), in the first GEMM phase and
    in the loop; and ptxas keeps the wgmmas asynchronous, one ``WARPGROUP.ARRIVE`` per GEMM
    issue (4: one code copy serves both consumers; a fifth for the delta warpgroup's tile),
    where a register shortage serialises them (warning C7511, an arrive per wgmma)."""
    sass = bt.sass(so, KERNEL)
    assert len(re.findall(r"\bLD\.E\.64 R\d+, desc\[UR\d+\]\[R\d+\.64\+0x", sass)) >= 2 * 15
    assert sass.count("WARPGROUP.ARRIVE") == 4 + 1


def test_prepass_is_the_fp16_one(so: Path) -> None:
    """The Hopper backend runs one pre-pass, which writes its FP16 operands: the module holds
    the FP16 policy's kernels (two tile passes and the reduce) and nothing of the codes
    pre-pass or of the expansion pass that used to follow it; each kernel without local memory,
    the tile kernel within the 128 registers of its 2 CTAs an SM."""
    names = re.findall(r"Function : (\S+)", bt.cuobjdump("--dump-sass", str(so)))
    assert sum("quantize_fp16_kernel" in n for n in names) == 2
    assert sum("segment_reduce_fp16_kernel" in n for n in names) == 1
    assert not [n for n in names if "expand_" in n or "quantize_kernel" in n
                or "segment_reduce_kernel" in n], names
    log = (so.parent / "build.log").read_text()
    entry = r"Compiling entry function '\S*(quantize_fp16_kernel|segment_reduce_fp16_kernel)\S*'"
    reports = re.findall(entry + r".*?\n(.*?Used (\d+) registers)", log, re.S)
    assert len(reports) == 3, log[-2000:]
    for kernel, report, registers in reports:
        assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                         report), report
        assert kernel != "quantize_fp16_kernel" or int(registers) <= 128, report
    module = bt.load(so)
    module.quantize_nvfp4_fp16  # noqa: B018  (exported)
    for gone in ("quantize_nvfp4", "expand_nvfp4_fp16"):
        with pytest.raises(AttributeError):
            getattr(module, gone)


def test_module_is_hopper_only() -> None:
    from flashinfer_h3.jit import KernelConfig

    with pytest.raises(ValueError, match="sm_90a"):
        KernelConfig("nvfp4_wgmma", arch="sm_120a")


def test_dynamic_item_order_and_folded_p_scale() -> None:
    """Production draws its items from the workspace counter (one ``ATOM.E.ADD`` of the TMA
    thread) and folds the P groups' 1 / s into the exponentials: its tile loop has no FMUL of
    Ptil by a reciprocal left, 100+ instructions fewer than the ``fold_p_scale=False`` build's;
    the ``dynamic_schedule=False`` build strides statically. Neither has local memory."""
    from flashinfer_h3.jit import KernelConfig, build_module

    production = bt.sass(Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a"))), KERNEL)
    assert len(re.findall(r"\bATOMG?\.E\.ADD", production)) == 1
    for flags in ({"dynamic_schedule": False}, {"fold_p_scale": False}):
        so = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a", flags=flags)))
        bt.assert_no_local_memory(so, KERNEL)
        if "dynamic_schedule" in flags:
            assert "ATOM" not in bt.sass(so, KERNEL)
        else:
            fmul_unfolded = len(re.findall(r"\bFMUL\b", bt.sass(so, KERNEL)))
            assert len(re.findall(r"\bFMUL\b", production)) <= fmul_unfolded - 100


def test_producer_waits_suspend() -> None:
    """The producer warpgroups' waits (the TMA thread's for free slots, the delta warpgroup's for
    K tiles and free delta buffers) carry try_wait's suspend-time hint (``NANOSLEEP.SYNCS``)
    instead of polling; the ``wait_sleep_ns=0`` benchmark build polls."""
    from flashinfer_h3.jit import KernelConfig, build_module

    production = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a")))
    assert len(re.findall(r"NANOSLEEP\.SYNCS 0x64\b", bt.sass(production, KERNEL))) >= 5
    config = KernelConfig("nvfp4_wgmma", arch="sm_90a", flags={"wait_sleep_ns": 0})
    polling = Path(build_module(config))
    assert "NANOSLEEP" not in bt.sass(polling, KERNEL)


def test_delta_benchmark_builds() -> None:
    """The delta products' other forms (benchmark builds), all without local memory:
    ``delta_mma_sync=True`` (production until 2026-12-06) as FP16 ``HMMA.16816.F32`` on three
    producer warps, no 64x8 wgmma, 384 threads, 2 KB less shared memory (no qbar rows);
    ``delta_wgmma_regs=True`` as ``HGMMA.64x8x16.F32`` with A from registers (8 k16 steps, the
    loop over the tile's two m64 blocks rolled), fed by ldmatrix, 512 threads split 40 / 72 /
    200, the same shared memory as production; and ``delta=False`` (the warpgroup writes the
    mask alone: no delta product at all). The consumers' 32 FP16 wgmmas are production's in all
    three; production launches 512 threads."""
    from flashinfer_h3.jit import KernelConfig, build_module

    production = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a")))
    smem = int(bt.load(production).attention_nvfp4_wgmma_smem_bytes())
    assert bt.max_threads(production, KERNEL)[0] == 512
    builds = {}
    for flag in ("delta_mma_sync", "delta_wgmma_regs", "delta"):
        flags = {flag: flag != "delta"}
        so = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a", flags=flags)))
        bt.assert_no_local_memory(so, KERNEL)
        sass = bt.sass(so, KERNEL)
        assert len(re.findall(re.escape(HGMMA) + " ", sass)) == 4 * 8
        smem_of = int(bt.load(so).attention_nvfp4_wgmma_smem_bytes())
        builds[flag] = (sass, smem_of, bt.max_threads(so, KERNEL)[0])
    sass, mma_sync_smem, threads = builds["delta_mma_sync"]
    assert re.search(r"HMMA\.16816\.F32 ", sass) and "HGMMA.64x8x16" not in sass
    assert mma_sync_smem == smem - 2048 and threads == 384
    sass, regs_smem, threads = builds["delta_wgmma_regs"]
    assert len(re.findall(r"HGMMA\.64x8x16\.F32 R\d+, R\d+, gdesc", sass)) == 8
    assert "LDSM" in sass and "HMMA.16816" not in sass
    assert regs_smem == smem <= MAX_SMEM and threads == 512
    for regs in (0x28, 0x48):
        assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {regs:#x}\b", sass), hex(regs)
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, 0xc8\b", sass)
    sass, _, _ = builds["delta"]
    assert "HGMMA.64x8x16" not in sass and "HMMA.16816" not in sass


def test_poly_exp2_build(so: Path) -> None:
    """``poly_exp2_every=32`` takes 2 of a tile's 64 exponentials a thread off MUFU, in both of the
    consumer's softmax copies (the first tile's and the loop's), without local memory and with
    production's 32 FP16 wgmmas."""
    from flashinfer_h3.jit import KernelConfig, build_module

    production = bt.sass(so, KERNEL)
    poly = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a",
                                          flags={"poly_exp2_every": 32})))
    bt.assert_no_local_memory(poly, KERNEL)
    sass = bt.sass(poly, KERNEL)
    assert len(re.findall(re.escape(HGMMA) + " ", sass)) == 4 * 8
    assert sass.count("MUFU.EX2") == production.count("MUFU.EX2") - 2 * 2


@pytest.mark.parametrize("mode", [1, 2], ids=["streaming", "skipped"])
def test_background_traffic_build(so: Path, mode: int) -> None:
    """``background_traffic`` (sm90/background_traffic.cuh): warps 1-3 of the TMA warpgroup
    stream 16-byte loads and stores with the streaming cache operator (``LDG.E.EF.128``,
    ``STG.E.EF.128``: two loads in each of its two pass loops, those that write and those that
    only read and code, and the two stores), which production has none of; production's 32 FP16
    wgmmas and their waits, the same shared memory. Mode 2 is the same code behind a run-time
    condition; the two keep one tile loop (ptxas reschedules it against production's, so mode 2
    is what mode 1 is timed against)."""
    from flashinfer_h3.jit import KernelConfig, build_module

    production = bt.sass(so, KERNEL)
    assert "LDG.E.EF.128" not in production and "STG.E.EF.128" not in production
    build = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a",
                                           flags={"background_traffic": mode})))
    sass = bt.sass(build, KERNEL)
    assert sass.count("LDG.E.EF.128") == 4 and sass.count("STG.E.EF.128") == 2
    assert len(re.findall(re.escape(HGMMA) + " ", sass)) == 4 * 8
    assert sass.count("WARPGROUP.DEPBAR") == production.count("WARPGROUP.DEPBAR")
    smem = int(bt.load(build).attention_nvfp4_wgmma_smem_bytes())
    assert smem == int(bt.load(so).attention_nvfp4_wgmma_smem_bytes())
    with pytest.raises(Exception, match="background_traffic"):
        build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a",
                                  flags={"background_traffic": 1, "delta_mma_sync": True}))


@pytest.mark.parametrize("flags", [
    {"delta_mma_sync": True, "delta_wgmma_regs": True},
    {"delta_mma_sync": True, "wide_consumers": True},
    {"delta_wgmma_regs": True, "wide_consumers": True},
])
def test_conflicting_delta_flags_do_not_build(flags: dict) -> None:
    """Two delta forms at once, or the wide consumers without the SS delta, stop the compile with
    an error naming the flags (rather than building one form quietly, which a benchmark would
    then label as another)."""
    from flashinfer_h3.jit import KernelConfig, build_module
    from flashinfer_h3.jit.env import JitBuildError

    with pytest.raises(JitBuildError, match="KernelConfig flag"):
        build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a", flags=flags))


REMOVED_FLAGS = ("row_divisor", "shared_space", "shared_delta_loads", "delta_table",
                 "table_prefetch", "pv_under_softmax", "prefetch_next_item", "early_item_publish",
                 "store_under_qk")


@pytest.mark.parametrize("flag", REMOVED_FLAGS)
def test_removed_builds_flags_are_refused(flag: str) -> None:
    """The flags of the builds measured and removed (listed with Nvfp4Variant in
    attention/sm90/nvfp4_kernel.cuh) are refused by name before any compile, so an old
    benchmark command fails instead of timing production under another build's label."""
    from flashinfer_h3.jit import KernelConfig

    with pytest.raises(ValueError, match=flag):
        KernelConfig("nvfp4_wgmma", arch="sm_90a", flags={flag: True})


# ---------------------------------------------------------------------------------------------
# e2m1_round_nonneg on the CPU
# ---------------------------------------------------------------------------------------------

ROUND_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define __device__
#define __forceinline__ inline
// The CUDA intrinsics it uses, as the IEEE operations they are (built with -ffp-contract=off).
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
// PTX min.f32 / max.f32 (FMNMX): a NaN operand gives the other one, signaling NaNs too (glibc's
// fminf returns NaN for those); the header's unqualified calls find these first.
namespace flashinfer_h3 {
static inline float fminf(float a, float b) { return a != a ? b : (b != b ? a : (a < b ? a : b)); }
static inline float fmaxf(float a, float b) { return a != a ? b : (b != b ? a : (a > b ? a : b)); }

// The f16x2 operations of the header's f16x2 forms, per half, as PTX defines them: FP16 values
// decoded exactly to double; fma.rn.f16x2 as one rounding to FP16 of the double fma (a b + c is
// exact in double for the operands the rounding uses: u C with u in {1, 2, 4} plus an FP16
// value); max / min.f16x2 returning the other operand for a NaN one.
static inline double half_to_double(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double mag =
      e == 0x1F ? (m ? NAN : INFINITY) : (e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25));
  return (h & 0x8000) ? -mag : mag;
}
// Round to FP16, nearest even (d's magnitude below 2^-14: the subnormal quantum 2^-24).
static inline uint16_t double_to_half_rn(double d) {
  if (d != d) return 0x7E00;
  const uint16_t sign = signbit(d) ? 0x8000 : 0;
  double a = fabs(d);
  int e = 0;
  frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
  const double q = a < 0x1p-14 ? 0x1p-24 : ldexp(1.0, e - 11);
  a = nearbyint(a / q) * q;  // the default rounding mode: to nearest, ties to even
  if (a >= 65520.0) return sign | 0x7C00;
  if (a < 0x1p-14) return sign | (uint16_t)(a * 0x1p24);
  frexp(a, &e);
  return sign | (uint16_t)((e + 14) << 10) | (uint16_t)(ldexp(a, 11 - e) - 1024.0);
}
static inline double nan_min(double a, double b) {
  return a != a ? b : (b != b ? a : (a < b ? a : b));
}
static inline double nan_max(double a, double b) {
  return a != a ? b : (b != b ? a : (a > b ? a : b));
}
template <class Op>
static inline uint32_t per_half(uint32_t a, uint32_t b, uint32_t c, Op op) {
  uint32_t out = 0;
  for (int i = 0; i < 2; ++i) {
    const int at = 16 * i;
    const double r = op(half_to_double(a >> at), half_to_double(b >> at), half_to_double(c >> at));
    out |= (uint32_t)double_to_half_rn(r) << (16 * i);
  }
  return out;
}
static inline uint32_t h2_fma_rn(uint32_t a, uint32_t b, uint32_t c) {
  return per_half(a, b, c, [](double x, double y, double z) { return fma(x, y, z); });
}
static inline uint32_t h2_max(uint32_t a, uint32_t b) {
  return per_half(a, b, 0, [](double x, double y, double) { return nan_max(x, y); });
}
static inline uint32_t h2_min(uint32_t a, uint32_t b) {
  return per_half(a, b, 0, [](double x, double y, double) { return nan_min(x, y); });
}
}  // namespace flashinfer_h3

#include "numerics/e2m1_round.cuh"

// rn_e2m1 of y >= 0 by searching the grid: the nearest value, a tie to the even code (index),
// 6 for everything past it (inf too); NaN -> 6 (fminf semantics, documented in the header).
static float grid_round(float y) {
  static const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  if (!(y <= 6.0f)) return 6.0f;
  int best = 0;
  for (int i = 1; i < 8; ++i) {
    const double d = fabs((double)y - grid[i]), e = fabs((double)y - grid[best]);
    if (d < e || (d == e && i % 2 == 0)) best = i;
  }
  return grid[best];
}

// Every non-negative pattern in [begin, end): returns -(first failing pattern) - 1, or 0.
extern "C" int64_t check_range(uint32_t begin, uint32_t end) {
  for (uint64_t u = begin; u < end; ++u) {
    const float y = __uint_as_float((uint32_t)u);
    const float got = flashinfer_h3::e2m1_round_nonneg(y), want = grid_round(y);
    if (__float_as_uint(got) != __float_as_uint(want)) return -(int64_t)u - 1;
  }
  return 0;
}

// Every pattern of [0, 7) in [begin, end) through e2m1_round_below7 (the kernel's fast path).
extern "C" int64_t check_range_below7(uint32_t begin, uint32_t end) {
  for (uint64_t u = begin; u < end; ++u) {
    const float y = __uint_as_float((uint32_t)u);
    if (!(y < 7.0f)) continue;
    const float got = flashinfer_h3::e2m1_round_below7(y), want = grid_round(y);
    if (__float_as_uint(got) != __float_as_uint(want)) return -(int64_t)u - 1;
  }
  return 0;
}

// Every non-negative FP16 pattern (+0 .. +inf and the NaNs) in the low half of an f16x2 word and
// a different one in the high half, through both f16x2 forms (the unsaturated one on values
// below 7): returns -(first failing low pattern) - 1, or 0.
extern "C" int64_t check_halves() {
  using flashinfer_h3::half_to_double;
  for (uint32_t lo = 0; lo < 0x8000u; ++lo) {
    const uint32_t hi = (lo * 40503u + 12345u) & 0x7FFFu;  // a permutation of the patterns
    const uint32_t y = lo | (hi << 16);
    const uint32_t sat = flashinfer_h3::e2m1_round_nonneg_h2(y);
    const uint32_t fast = flashinfer_h3::e2m1_round_below7_h2(y);
    for (int i = 0; i < 2; ++i) {
      const uint16_t in = (uint16_t)(y >> (16 * i));
      const uint16_t got_sat = (uint16_t)(sat >> (16 * i)), got_fast = (uint16_t)(fast >> (16 * i));
      const float want = grid_round((float)half_to_double(in));
      // The value and a + sign: 0 comes out as +0.
      const bool bad_sat = half_to_double(got_sat) != want || (got_sat & 0x8000u);
      const bool bad_fast = half_to_double(got_fast) != want || (got_fast & 0x8000u);
      if (bad_sat || (half_to_double(in) < 7.0 && bad_fast)) return -(int64_t)lo - 1;
    }
  }
  return 0;
}

extern "C" void round_all(const float* y, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = flashinfer_h3::e2m1_round_nonneg(y[i]);
}
"""


@pytest.fixture(scope="module")
def rounding(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib_ = bt.build_host_library(tmp_path_factory.mktemp("e2m1_round"), "e2m1_round", ROUND_SOURCE)
    lib_.check_range.restype = ctypes.c_int64
    lib_.check_range.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    lib_.check_range_below7.restype = ctypes.c_int64
    lib_.check_range_below7.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    lib_.check_halves.restype = ctypes.c_int64
    lib_.check_halves.argtypes = []
    lib_.round_all.restype = None
    lib_.round_all.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib_


def test_e2m1_round_every_nonnegative_float(rounding: ctypes.CDLL) -> None:
    from concurrent.futures import ThreadPoolExecutor

    # +0 .. +inf and every NaN payload: 2^31 patterns, in 8 slices over two threads.
    edges = [i * (1 << 28) for i in range(9)]
    with ThreadPoolExecutor(2) as pool:
        ranges = zip(edges[:-1], edges[1:], strict=True)
        results = list(pool.map(lambda r: rounding.check_range(*r), ranges))
    bad = [-r - 1 for r in results if r < 0]
    assert not bad, f"first failing pattern 0x{bad[0]:08x}"


def test_e2m1_round_below7_every_float_below_7(rounding: ctypes.CDLL) -> None:
    seven = 0x40E00000  # bits of 7.0
    mid = seven // 2
    assert rounding.check_range_below7(0, mid) == 0
    assert rounding.check_range_below7(mid, seven) == 0


def test_e2m1_round_h2_every_half(rounding: ctypes.CDLL) -> None:
    """The f16x2 forms the kernel uses (``kF16Rounding``): every non-negative FP16 pattern in
    both halves against the grid search, and ties to the even code."""
    result = rounding.check_halves()
    assert result == 0, f"first failing FP16 pattern 0x{-result - 1:04x}"


def test_e2m1_round_matches_formats(rounding: ctypes.CDLL) -> None:
    torch = pytest.importorskip("torch")
    from flashinfer_h3 import formats as F

    ties = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 7.0, 1e30, -0.0])
    g = torch.Generator().manual_seed(0)
    sample = torch.rand(200_000, generator=g) * 8
    y = torch.cat([ties, sample, torch.nextafter(ties, torch.tensor(float("inf")))]).float()
    y = y.abs().contiguous()
    got = torch.empty_like(y)
    rounding.round_all(y.data_ptr(), y.numel(), got.data_ptr())
    want = F.e2m1_to_float(F.rn_e2m1(y))
    assert torch.equal(got, want)


def test_sass_tile_loop_tells_a_kept_loop_from_a_rescheduled_one(so: Path) -> None:
    """benchmarks/sass_tile_loop.py, the CPU check of whether a build kept production's tile loop.
    Production has one consumer loop, the steady-state tile: PV(t - 1) and QK^T(t), 8 k16 wgmmas
    each; the waits' out-of-line retry paths are no loops. Production against itself keeps every
    instruction. ``background_traffic=2`` (a change in the TMA warpgroup's idle warps only) gets
    it rescheduled: fewer instructions in production's order (thirty-seventh session: 640 of
    1,018). (The thirty-fourth session's ``early_item_publish`` build, removed, kept the loop up
    to register names, stall cycles too.)"""
    from flashinfer_h3.jit import KernelConfig, build_module

    tool = bt.sass_tile_loop()
    (loop,) = tool.consumer_loops(bt.sass(so, KERNEL))
    print(f"production: {len(loop.instructions)} instructions, {loop.stall_cycles} stall cycles")
    assert loop.wgmmas == 16 and loop.stall_cycles > len(loop.instructions) // 2
    # A steady-state tile's path: some of the loop, the retries and one-thread arrivals off it.
    assert 0 < loop.path_instructions < len(loop.instructions)
    assert 0 < loop.path_stall_cycles < loop.stall_cycles
    assert tool.kept_order(loop.instructions, loop.instructions) == len(loop.instructions)
    build = Path(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a",
                                           flags={"background_traffic": 2})))
    (moved,) = tool.consumer_loops(bt.sass(build, KERNEL))
    kept_order = tool.kept_order(loop.instructions, moved.instructions)
    print(f"background_traffic=2: {kept_order} of {len(moved.instructions)} in production's order")
    assert moved.wgmmas == 16 and kept_order < len(moved.instructions)
