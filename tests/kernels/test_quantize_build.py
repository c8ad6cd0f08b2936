"""CPU tests of the quantization pre-pass template (templates/quantize.cu.jinja + prepass.cuh).

The template renders for both ops and for the nvfp4_wgmma module (whose pre-pass writes the
Hopper kernel's FP16 operands: quantize_nvfp4_fp16), compiles with nvcc for sm_90a and sm_120a
(the FP16 pre-pass: sm_90a) with the JIT's own flags, every kernel fits its budget (no stack
frame, no spills, the tile kernel within the 128 registers of 2 CTAs an SM), sm_120a encodes E2M1
with the hardware cvt while sm_90a has none, and the .so loads through tvm-ffi without a GPU,
exports only the rendered op and rejects CPU tensors.

Without a GPU the kernels themselves run too: prepass.cuh compiles as host C++ (nvcc -x c++)
under a small emulation of the CUDA builtins (EMULATOR_SOURCE: one std::thread per CUDA thread,
CTAs one at a time, cp.async copies applied at the wait or eagerly at the issue, the f16x2
conversion and product as IEEE operations), and

- the shortcuts of the NVFP4 group quantizer are checked for every float: the FP32-pipe E2M1
  encoder against formats.cuh's, and the FMA division by 6 against a correctly rounded one;
- the FP16 policy's element rounding (e2m1_value) is checked on every float bit pattern
  against the decode of formats.cuh's encoder, signed zeros included;
- the group quantizer matches formats.py on random and adversarial groups, and the FP16
  policy's groups (nvfp4_group_fp16) are the decoded codes, bit for bit;
- the three launches (tile pass 1, reduce, tile pass 2), emulated, produce outputs that pass
  the GPU test's own checks (test_quantize_gpu.check_call: bit-exact codes and scales, or FP16
  operands with their zero padding, means, untouched unused bytes).

``render_quantize`` / ``build_quantize_so`` are also used by the GPU test and the benchmark to
build the pre-pass alone (the JIT's modules also compile the attention templates).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import binary_tools as bt
import pytest

QUANTIZE_TEMPLATE = "quantize.cu.jinja"
OPS = ("nvfp4", "fp8")
ARCHS = ("sm_90a", "sm_120a")
FP16_MODULE = "nvfp4_wgmma"  # its quantize.cu.jinja exports quantize_nvfp4_fp16 (sm_90a only)
#: (module, arch) of every pre-pass build.
BUILDS = tuple((op, arch) for op in OPS for arch in ARCHS) + ((FP16_MODULE, "sm_90a"),)
KERNELS = ("segment_reduce_kernel", "quantize_kernel")
FP16_KERNELS = ("segment_reduce_fp16_kernel", "quantize_fp16_kernel")
TILE_KERNEL_MAX_REGISTERS = 128  # 2 CTAs of 256 threads an SM (__launch_bounds__(256, 2))


def render_quantize(module: str, arch: str) -> str:
    """The pre-pass binding of JIT module ``module`` (``nvfp4``, ``fp8`` or ``nvfp4_wgmma``) for
    ``arch``, rendered with the JIT's template context."""
    from flashinfer_h3.jit import KernelConfig, render_template

    return render_template(QUANTIZE_TEMPLATE, KernelConfig(module, 128, arch).template_context())


def build_quantize_so(
    op: str, arch: str, out_dir: Path, include_dirs: tuple[Path, ...] = ()
) -> tuple[Path, str]:
    """Compile the pre-pass of module ``op`` (``nvfp4``, ``fp8``, or ``nvfp4_wgmma`` for the FP16
    pre-pass) alone into ``out_dir``; returns (.so path, nvcc output).

    ``include_dirs`` come before the package's headers (to build against a modified header).
    The file names carry a digest of the source, the headers and the flags, so a build is
    reused from ``out_dir`` only when nothing it depends on changed.
    """
    from flashinfer_h3.jit import find_nvcc
    from flashinfer_h3.jit.env import include_dir, tvm_ffi_include_dirs
    from flashinfer_h3.jit.spec import cuda_flags, link_flags

    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    source = render_quantize(op, arch)
    includes = [*include_dirs, include_dir(), *tvm_ffi_include_dirs()]
    flags = [*cuda_flags(arch), *link_flags(), *[f"-I{d}" for d in includes]]
    digest = hashlib.sha256("\0".join([str(nvcc), source, *flags]).encode())
    for d in includes[: len(include_dirs) + 1]:
        for header in sorted(Path(d).rglob("*.cuh")):
            digest.update(header.relative_to(d).as_posix().encode() + header.read_bytes())
    stem = f"quantize_{op}_{arch}_{digest.hexdigest()[:16]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    src, so, log_path = (out_dir / f"{stem}{ext}" for ext in (".cu", ".so", ".log"))
    if so.is_file() and log_path.is_file():
        return so, log_path.read_text()
    src.write_text(source)
    cmd = [str(nvcc), *flags, str(src), "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        so.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{' '.join(cmd)}\n{log[-4000:]}")
    log_path.write_text(log)
    return so, log


def parse_ptxas(log: str) -> dict[tuple[str, str], dict[str, int]]:
    """``{(kernel short name, arch): {registers, stack, spill_stores, spill_loads, instances}}``.

    A kernel instantiated more than once (the tile kernel: one per pass) reports the largest
    value of each resource over its instances.
    """
    entries: list[tuple[tuple[str, str], dict[str, int]]] = []
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            name = next((k for k in KERNELS + FP16_KERNELS if k in m.group(1)), m.group(1))
            entries.append(((name, m.group(2)), {}))
            continue
        if not entries:
            continue
        info = entries[-1][1]
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            info.update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        m = re.search(r"Used (\d+) registers", line)
        if m:
            info["registers"] = int(m.group(1))
    out: dict[tuple[str, str], dict[str, int]] = {}
    for key, info in entries:
        merged = out.setdefault(key, {"instances": 0})
        merged["instances"] += 1
        for name, value in info.items():
            merged[name] = max(merged.get(name, value), value)
    return out


@pytest.mark.parametrize("op", OPS)
def test_renders_only_its_op(op: str) -> None:
    text = render_quantize(op, "sm_90a")
    other = "fp8" if op == "nvfp4" else "nvfp4"
    assert f"TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_{op}," in text
    assert f"quantize_{other}" not in text
    assert "quantize_nvfp4_fp16" not in text and "Fp16Outputs" not in text
    assert "{{" not in text and "{%" not in text
    assert "use_fast_math" not in text


def test_fp16_module_renders_only_the_fp16_prepass() -> None:
    """The nvfp4_wgmma module's pre-pass is the FP16 one alone: no codes quantizer is compiled
    into it (its backend never reads codes)."""
    text = render_quantize(FP16_MODULE, "sm_90a")
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_nvfp4_fp16," in text
    assert "quantize_nvfp4(" not in text and "quantize_fp8" not in text
    assert "qz::Outputs<" not in text and "Fp16Outputs<qz::Op::kNvfp4>" in text
    assert "{{" not in text and "{%" not in text


def test_unknown_op_is_a_compile_error() -> None:
    from flashinfer_h3.jit import render_template

    text = render_template(QUANTIZE_TEMPLATE, {"op": "int8", "head_dim": 128, "arch": "sm_90a",
                                                "prepass_output": "codes", "flags": {}})
    assert "#error" in text


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, str]]:
    out = tmp_path_factory.mktemp("quantize_build")
    return {(op, arch): build_quantize_so(op, arch, out) for op, arch in BUILDS}


@pytest.mark.nvcc
@pytest.mark.parametrize("op,arch", BUILDS)
def test_compiles_within_budget(builds, op: str, arch: str) -> None:
    _, log = builds[(op, arch)]
    usage = parse_ptxas(log)
    kernels, other = (FP16_KERNELS, KERNELS) if op == FP16_MODULE else (KERNELS, FP16_KERNELS)
    for kernel in kernels:
        info = usage.get((kernel, arch))
        assert info is not None, f"{kernel} missing from the {op} {arch} build:\n{log[-2000:]}"
        assert info["stack"] == 0 and info["spill_stores"] == 0 and info["spill_loads"] == 0, (
            f"{op} {arch} {kernel} uses local memory: {info}"
        )
        assert 0 < info["registers"] <= 255
        print(f"{op} {arch} {kernel}: {info}")
    assert not any((kernel, arch) in usage for kernel in other), "the other policy's kernels"
    tile = usage[(kernels[1], arch)]
    assert tile["registers"] <= TILE_KERNEL_MAX_REGISTERS
    assert tile["instances"] == 2, "one tile kernel per pass (Q and statistics; K and V)"


def _sass(so: Path) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not on PATH")
    return subprocess.run(
        [tool, "-sass", str(so)], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_e2m1_conversion_per_arch(builds, arch: str) -> None:
    sass = _sass(builds[("nvfp4", arch)][0])
    assert "LDL" not in sass and "STL" not in sass
    hardware = "F2FP.SATFINITE.E2M1" in sass
    assert hardware == (arch == "sm_120a"), f"{arch}: hardware E2M1 cvt present: {hardware}"
    assert "F2FP.SATFINITE.E4M3" in sass  # the UE4M3 scales use cvt on both archs


@pytest.mark.nvcc
def test_fp16_prepass_sass(builds) -> None:
    """The FP16 pre-pass (sm_90a): the scale's f16x2 cvt and the values' FP16 pack and product
    (the decode's own HMUL2), the V tiles staged through shared memory (4-byte stores, 16-byte
    loads) and written with 16-byte stores; no local memory, no E2M1 cvt (Hopper has none)."""
    sass = _sass(builds[(FP16_MODULE, "sm_90a")][0])
    assert "LDL" not in sass and "STL" not in sass
    assert "F2FP.SATFINITE.E2M1" not in sass
    for instruction in ("F2FP.SATFINITE.E4M3", "F2FP.F16.F32.PACK_AB", "HMUL2", "LDS.128",
                        "STG.E.128"):
        assert instruction in sass, instruction


@pytest.mark.nvcc
@pytest.mark.parametrize("op", (*OPS, FP16_MODULE))
def test_loads_and_checks_arguments_without_gpu(builds, op: str) -> None:
    torch = pytest.importorskip("torch")
    tvm_ffi = pytest.importorskip("tvm_ffi")
    mod = tvm_ffi.load_module(str(builds[(op, "sm_90a")][0]))
    export = {"nvfp4": "quantize_nvfp4", "fp8": "quantize_fp8", FP16_MODULE: "quantize_nvfp4_fp16"}
    for name, other in export.items():
        if name != op:
            with pytest.raises(AttributeError):
                getattr(mod, other)
    fn = getattr(mod, export[op])
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    table = torch.zeros(2, dtype=torch.int32)
    blocks = torch.zeros(1, 4, dtype=torch.int32)
    regions = [torch.zeros(1)] * {"nvfp4": 8, "fp8": 7, FP16_MODULE: 5}[op]
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        fn(x, x, x, table, table, table, blocks, *regions)
    with pytest.raises(TypeError):
        fn(x, x, x)


# ---------------------------------------------------------------------------------------------
# The kernels on the CPU
# ---------------------------------------------------------------------------------------------

# Host build of prepass.cuh: CUDA builtins as host code (the intrinsics are IEEE single
# operations, so exact; the build disables FP contraction), kernels as plain functions run by
# one std::thread per CUDA thread. __shared__ variables become statics and the dynamic shared
# memory a per-CTA buffer of stale bytes (CTAs run one at a time); __syncthreads, __syncwarp and
# the warp shuffles are barriers (a deadlock, e.g. divergent barriers, aborts after 60 s).
# cp.async copies apply at the wait (mode 0: a stage read before its wait sees stale bytes) or at
# the issue (mode 1: a stage refilled while another thread still reads it is caught by the racing
# threads). The f16x2 conversion and product are IEEE FP16 roundings (round to nearest even).
EMULATOR_SOURCE = r"""
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

struct EmuDim3 { unsigned x, y, z; };
thread_local EmuDim3 emu_thread_idx{0, 0, 0};
thread_local EmuDim3 emu_block_idx{0, 0, 0};
EmuDim3 emu_grid_dim{1, 1, 1};
EmuDim3 emu_block_dim{1, 1, 1};
#define threadIdx emu_thread_idx
#define blockIdx emu_block_idx
#define gridDim emu_grid_dim
#define blockDim emu_block_dim
#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __frcp_rn(float a) { return 1.0f / a; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
// NaN and -0 -> +0, as .SAT does.
static inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32);
}
static inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>((((static_cast<uint64_t>(hi) << 32) | lo) << (shift & 31)) >> 32);
}
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
namespace flashinfer_h3 {
// PTX min.f32 / max.f32 (FMNMX): a NaN operand gives the other one, a signaling NaN too (glibc's
// fminf / fmaxf return NaN for those); the headers' unqualified calls find these first.
static inline float fminf(float a, float b) { return a != a ? b : (b != b ? a : (a < b ? a : b)); }
static inline float fmaxf(float a, float b) { return a != a ? b : (b != b ? a : (a > b ? a : b)); }
}  // namespace flashinfer_h3

class Barrier {
 public:
  void reset(int n) { n_ = n; count_ = 0; }
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return gen_ != gen; })) {
      fprintf(stderr, "emulated kernel deadlocked at a barrier\n");
      std::_Exit(3);
    }
  }
 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_ = 1, count_ = 0;
  uint64_t gen_ = 0;
};

static Barrier g_cta_barrier;
struct WarpExchange { uint64_t slot[32]; Barrier bar; };
static std::vector<WarpExchange*> g_warps;

static inline void __syncthreads() { g_cta_barrier.wait(); }

template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  if (mask != 0xFFFFFFFFu) abort();
  WarpExchange& w = *g_warps[threadIdx.x / 32];
  const unsigned lane = threadIdx.x % 32;
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  w.slot[lane] = bits;
  w.bar.wait();
  const uint64_t got = w.slot[lane ^ lane_mask];
  w.bar.wait();
  T out;
  memcpy(&out, &got, sizeof(T));
  return out;
}

#include "quantize/prepass.cuh"

namespace flashinfer_h3 {
namespace quantize {

static int g_copy_mode = 0;
struct Copy { void* dst; const void* src; uint32_t bytes, size; };
thread_local std::vector<std::vector<Copy>> t_groups;  // committed, oldest first
thread_local std::vector<Copy> t_open;
static std::vector<unsigned char> g_smem;

static void apply(const Copy& c) {
  unsigned char buf[16] = {0};
  memcpy(buf, c.src, c.bytes);
  memcpy(c.dst, buf, c.size);
}
static void enqueue(const Copy& c) {
  if (g_copy_mode == 1) apply(c); else t_open.push_back(c);
}
void emulated_cp_async_16(void* dst, const void* src, uint32_t bytes) {
  if (bytes != 0 && bytes != 16) abort();
  enqueue({dst, src, bytes, 16});
}
void emulated_cp_async_4(void* dst, const void* src) { enqueue({dst, src, 4, 4}); }
void emulated_cp_async_commit() { t_groups.push_back(t_open); t_open.clear(); }
void emulated_cp_async_wait(int pending) {
  while (static_cast<int>(t_groups.size()) > pending) {
    for (const Copy& c : t_groups.front()) apply(c);
    t_groups.erase(t_groups.begin());
  }
}
// 128-byte aligned, as the stages of the ring are (alignas(128)).
void* emulated_dynamic_smem() {
  const uintptr_t at = reinterpret_cast<uintptr_t>(g_smem.data());
  return g_smem.data() + ((128 - at % 128) % 128);
}

void emulated_syncwarp() { g_warps[threadIdx.x / 32]->bar.wait(); }

// float -> FP16 bits, round to nearest even (cvt.rn.f16.f32): subnormal quantum 2^-24, overflow
// to inf, NaN -> 0x7FFF.
static uint32_t f16_rn(float x) {
  const uint32_t sign = (__float_as_uint(x) >> 16) & 0x8000u;
  if (isnan(x)) return 0x7FFFu;
  const float a = fabsf(x);
  if (a >= 65520.0f) return sign | 0x7C00u;
  if (a < 0x1p-14f) return sign | static_cast<uint32_t>(nearbyintf(a * 0x1p24f));
  uint32_t u = __float_as_uint(a);
  u += 0xFFFu + ((u >> 13) & 1u);  // RN-even to 10 mantissa bits (a carry bumps the exponent)
  return sign | (((u >> 23) - 112u) << 10) | ((u >> 13) & 0x3FFu);
}

// FP16 bits -> float, exact.
static float f16_value(uint32_t h) {
  const int e = static_cast<int>((h >> 10) & 0x1Fu);
  const float m = static_cast<float>(h & 0x3FFu);
  const float mag = e == 0x1F ? (m != 0.0f ? NAN : INFINITY)
                              : (e == 0 ? ldexpf(m, -24) : ldexpf(1024.0f + m, e - 25));
  return (h & 0x8000u) ? -mag : mag;
}

uint32_t emulated_f16x2(float lo, float hi) { return f16_rn(lo) | f16_rn(hi) << 16; }

// mul.rn.f16x2: the FP32 product of two FP16 values is exact (22 significant bits), rounded
// once to FP16.
uint32_t emulated_f16x2_mul(uint32_t a, uint32_t b) {
  return f16_rn(f16_value(a & 0xFFFFu) * f16_value(b & 0xFFFFu)) |
         f16_rn(f16_value(a >> 16) * f16_value(b >> 16)) << 16;
}

// cvt.rn.satfinite.e4m3: RN-even, subnormal steps of 2^-9 below 2^-6, |x| > 448 -> 448,
// NaN -> 0x7F.
uint32_t emulated_e4m3(float x) {
  const uint32_t sign = (__float_as_uint(x) >> 24) & 0x80u;
  if (isnan(x)) return 0x7Fu;
  float a = fabsf(x);
  if (a > 448.0f) a = 448.0f;
  if (a < 0x1p-6f) return sign | static_cast<uint32_t>(nearbyintf(a * 512.0f));
  uint32_t b = __float_as_uint(a);
  b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & ~0xFFFFFu;
  return sign | ((b >> 23) - 120u) << 3 | ((b >> 20) & 7u);
}

}  // namespace quantize
}  // namespace flashinfer_h3

namespace qz = flashinfer_h3::quantize;

template <class F>
static void run_grid(int grid, int block, size_t smem_bytes, F&& body) {
  emu_grid_dim = {static_cast<unsigned>(grid), 1, 1};
  emu_block_dim = {static_cast<unsigned>(block), 1, 1};
  g_cta_barrier.reset(block);
  for (auto* w : g_warps) delete w;
  g_warps.clear();
  for (int i = 0; i < (block + 31) / 32; ++i) {
    g_warps.push_back(new WarpExchange());
    g_warps.back()->bar.reset(32);
  }
  for (int b = 0; b < grid; ++b) {
    qz::g_smem.assign(smem_bytes + 128, 0xA5);
    std::vector<std::thread> threads;
    for (int t = 0; t < block; ++t) {
      threads.emplace_back([&, t, b] {
        emu_thread_idx = {static_cast<unsigned>(t), 0, 0};
        emu_block_idx = {static_cast<unsigned>(b), 0, 0};
        qz::t_groups.clear();
        qz::t_open.clear();
        body();
        qz::emulated_cp_async_wait(0);
      });
    }
    for (auto& th : threads) th.join();
  }
}

// The three launches of launch_quantize (whose <<<>>> syntax a host compiler cannot read), for
// any output policy: the kernels launch.cuh picks (tile_kernel, reduce_kernel).
template <class Out, qz::Pass pass, int kStages>
static void emulate_tiles(const qz::Inputs& in, const qz::Tables& tb, const Out& out,
                          int grid_cap) {
  const qz::ItemMap map = qz::make_item_map<Out::kOp, pass>(tb, in.heads);
  const int grid = map.items < grid_cap ? map.items : grid_cap;
  constexpr auto kernel = qz::tile_kernel<Out, pass, kStages>();
  run_grid(grid, qz::kThreads, qz::pipe_smem_bytes<kStages>(), [&] { kernel(in, tb, out, map); });
}

template <class Out, qz::Pass pass>
static void emulate_tiles(const qz::Inputs& in, const qz::Tables& tb, const Out& out, int grid_cap,
                          int stages) {
  if (stages == 2)
    emulate_tiles<Out, pass, 2>(in, tb, out, grid_cap);
  else
    emulate_tiles<Out, pass, 3>(in, tb, out, grid_cap);
}

// kWithQ = false: launch 1 without its Q items (Pass::kStats, launch_quantize's kWithQ).
template <bool kWithQ = true, class Out>
static void emulate_launches(const qz::Inputs& in, const qz::Tables& tb, const Out& out,
                             int grid_cap, int stages) {
  const int tiles = tb.num_qblocks * in.heads;
  constexpr qz::Pass kFirst = kWithQ ? qz::Pass::kQAndStats : qz::Pass::kStats;
  if (tiles > 0) emulate_tiles<Out, kFirst>(in, tb, out, grid_cap, stages);
  if (tb.segments * in.heads > 0) {
    const qz::ReduceShape shape = qz::reduce_shape(tb.num_qblocks, tb.segments);
    constexpr auto reduce = qz::reduce_kernel<Out>();
    run_grid(tb.segments * in.heads * shape.split, qz::kHeadDim / shape.split * shape.slices, 0,
             [&] { reduce(in, tb, out, shape.split); });
  }
  if (tiles > 0) emulate_tiles<Out, qz::Pass::kKAndV>(in, tb, out, grid_cap, stages);
}

// op 0: NVFP4 codes, 1: FP8 codes, 2: the FP16 policy (r = kbar, qbar, q_f16, k_f16, v_f16;
// v_code_row = vkeys_cap), 3: FP8 codes without Q (launch 1 takes only the statistics).
extern "C" int emulate_quantize(int op, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                int64_t tokens, int heads, const int* seg_bounds,
                                const int* vkey_start, const int* qblock_start, const int* qblocks,
                                int segments, int nqb, void** r, int64_t v_code_row,
                                int64_t k_scale_row, int grid_cap, int copy_mode, int stages) {
  qz::g_copy_mode = copy_mode;
  const qz::Inputs in{q, k, v, tokens, heads};
  const qz::Tables tb{seg_bounds, vkey_start, qblock_start, qblocks, segments, nqb};
  if (op == 2) {
    const qz::Fp16Outputs<qz::Op::kNvfp4> out{
        static_cast<float*>(r[0]),    static_cast<float*>(r[1]),    static_cast<uint16_t*>(r[2]),
        static_cast<uint16_t*>(r[3]), static_cast<uint16_t*>(r[4]), v_code_row};
    emulate_launches(in, tb, out, grid_cap, stages);
  } else if (op == 0) {
    const qz::Outputs<qz::Op::kNvfp4> out{
        static_cast<float*>(r[0]),   static_cast<float*>(r[1]),   static_cast<uint8_t*>(r[2]),
        static_cast<uint8_t*>(r[3]), static_cast<uint8_t*>(r[4]), static_cast<uint8_t*>(r[5]),
        static_cast<uint8_t*>(r[6]), static_cast<uint8_t*>(r[7]), v_code_row};
    emulate_launches(in, tb, out, grid_cap, stages);
  } else {
    const qz::Outputs<qz::Op::kFp8> out{
        static_cast<float*>(r[0]),   static_cast<uint8_t*>(r[1]), static_cast<float*>(r[2]),
        static_cast<uint8_t*>(r[3]), static_cast<float*>(r[4]),   static_cast<uint8_t*>(r[5]),
        static_cast<float*>(r[6]),   v_code_row,                  k_scale_row};
    if (op == 3) {
      emulate_launches<false>(in, tb, out, grid_cap, stages);
    } else {
      emulate_launches(in, tb, out, grid_cap, stages);
    }
  }
  return 0;
}

// Every y' in [begin, end) (bit patterns, both signs): e2m1_top_nibble's code against
// formats.cuh's encoder of y' 2^110 (exact for normal y'); a subnormal y' (|x r| < 2^-16) must
// give index 0 with its sign. Returns -(first failing pattern) - 1, or 0.
extern "C" int64_t check_e2m1_top_nibble(uint32_t begin, uint32_t end) {
  for (uint64_t u = begin; u < end; ++u) {
    for (uint32_t sign = 0; sign < 2; ++sign) {
      const float yp = __uint_as_float(static_cast<uint32_t>(u) | sign << 31);
      const uint32_t want =
          u < 0x00800000u ? sign << 3 : flashinfer_h3::e2m1_from_float_soft(yp * 0x1p110f);
      if (qz::e2m1_top_nibble(yp) >> 28 != want) return -static_cast<int64_t>(u) - 1;
    }
  }
  return 0;
}

// Every finite a >= 0 in [begin, end): div6_rn against the correctly rounded a / 6. Returns
// -(first pattern that fails) - 1, else the number of quotients that differ: allowed only where
// a / 6 is subnormal, and only if its E4M3 code (0) is the same.
extern "C" int64_t check_div6(uint32_t begin, uint32_t end) {
  int64_t differ = 0;
  for (uint64_t u = begin; u < end; ++u) {
    const float a = __uint_as_float(static_cast<uint32_t>(u));
    if (!(a <= 3.40282347e38f)) continue;
    const float want = a / 6.0f, got = qz::div6_rn(a);
    if (__float_as_uint(want) != __float_as_uint(got)) {
      if (qz::emulated_e4m3(want) != qz::emulated_e4m3(got) || want >= 0x1p-126f)
        return -static_cast<int64_t>(u) - 1;
      ++differ;
    }
  }
  return differ;
}

// nvfp4_group over `groups` groups of 16: codes (8 bytes) and scale bytes out; returns how many
// groups differ from formats.cuh's steps (nvfp4_scale_from_amax, nvfp4_scaled, the soft encoder).
extern "C" int64_t quantize_groups(const float* x, int64_t groups, uint8_t* codes,
                                   uint8_t* scales) {
  float table[128];
  for (uint32_t b = 0; b < 128; ++b) table[b] = qz::nvfp4_recip_scaled(b);
  int64_t differ = 0;
  for (int64_t g = 0; g < groups; ++g) {
    float xs[16];
    memcpy(xs, x + 16 * g, sizeof(xs));
    const qz::Nvfp4Group got = qz::nvfp4_group(xs, table);
    float amax = 0.0f;
    for (int e = 0; e < 16; ++e) amax = fmaxf(amax, fabsf(xs[e]));
    const uint32_t code = qz::emulated_e4m3(amax / 6.0f);
    const float value = flashinfer_h3::e4m3_to_float(static_cast<uint8_t>(code));
    const float recip = value == 0.0f ? 0.0f : 1.0f / value;
    float lo[8], hi[8];
    for (int e = 0; e < 8; ++e) {
      lo[e] = recip == 0.0f ? 0.0f : xs[e] * recip;
      hi[e] = recip == 0.0f ? 0.0f : xs[8 + e] * recip;
    }
    differ += got.scale != code || got.codes.x != flashinfer_h3::e2m1x8_from_float(lo) ||
              got.codes.y != flashinfer_h3::e2m1x8_from_float(hi);
    memcpy(codes + 8 * g, &got.codes, 8);
    scales[g] = static_cast<uint8_t>(got.scale);
  }
  return differ;
}

// Every float pattern y in [begin, end) (both signs): e2m1_value(y) (the FP16 policy's element,
// before the scale) against the decode of formats.cuh's encoder of y (the code the code path
// stores), as float bits, so -0 and +0 differ; and with the sign dropped (a zero scale's +0 path)
// against the magnitude. Returns -(first failing pattern) - 1, or 0.
static const float kE2M1Grid[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

extern "C" int64_t check_e2m1_value(uint64_t begin, uint64_t end) {
  for (uint64_t u = begin; u < end; ++u) {
    const float y = __uint_as_float(static_cast<uint32_t>(u));
    const float want = kE2M1Grid[flashinfer_h3::e2m1_from_float_soft(y)];
    const float got = qz::e2m1_value(y, 0x80000000u);
    const float magnitude = qz::e2m1_value(y, 0u);
    if (__float_as_uint(got) != __float_as_uint(want) ||
        __float_as_uint(magnitude) != __float_as_uint(fabsf(want)))
      return -static_cast<int64_t>(u) - 1;
  }
  return 0;
}

// nvfp4_group_fp16 over `groups` groups of 16: 8 f16x2 words each out; returns how many groups
// differ from nvfp4_group's codes decoded as the expansion did (the E2M1 value as FP16 times the
// scale as FP16, one FP16 product).
extern "C" int64_t quantize_groups_fp16(const float* x, int64_t groups, uint32_t* out) {
  float table[128];
  for (uint32_t b = 0; b < 128; ++b) table[b] = qz::nvfp4_recip_scaled(b);
  int64_t differ = 0;
  for (int64_t g = 0; g < groups; ++g) {
    float xs[16];
    memcpy(xs, x + 16 * g, sizeof(xs));
    uint32_t got[8];
    qz::nvfp4_group_fp16(xs, table, got);
    const qz::Nvfp4Group codes = qz::nvfp4_group(xs, table);
    const uint32_t s2 = qz::ue4m3_f16x2(codes.scale);
    bool same = true;
    for (int i = 0; i < 8; ++i) {
      const uint32_t word = i < 4 ? codes.codes.x : codes.codes.y;
      const uint32_t byte = (word >> (8 * (i % 4))) & 0xFFu;
      const uint32_t pair = qz::emulated_f16x2(kE2M1Grid[byte & 0xF], kE2M1Grid[byte >> 4]);
      same = same && got[i] == qz::emulated_f16x2_mul(pair, s2);
    }
    differ += !same;
    memcpy(out + 8 * g, got, sizeof(got));
  }
  return differ;
}

// The FP16 V staging addresses of every warp and lane (the header's own functions): stores
// [8 warps][32 lanes][4 k][8 i], loads [8][32][8 jj], and the byte offsets copy_columns reads
// [8][32][16 keys] (8 bytes each), all as byte offsets in a stage's tile.
extern "C" void v_staging_offsets(uint32_t* stores, uint32_t* loads, uint32_t* reads) {
  static qz::Stage stage;  // its tile holds its own 8-byte offsets: copy_columns returns them
  uint2* halves = reinterpret_cast<uint2*>(stage.tile);
  for (uint32_t h = 0; h < sizeof(stage.tile) / 8; ++h) halves[h] = make_uint2(8 * h, 0);
  for (int warp = 0; warp < 8; ++warp) {
    for (int lane = 0; lane < 32; ++lane) {
      const int t = 32 * warp + lane;
      emu_thread_idx = {static_cast<unsigned>(t), 0, 0};
      const qz::VStaging at = qz::v_staging(warp, lane);
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 8; ++i) stores[(t * 4 + k) * 8 + i] = qz::v_staging_store_at(at, k, i);
      for (int jj = 0; jj < 8; ++jj) loads[t * 8 + jj] = qz::v_staging_load_at(at, jj);
      uint2 w[16];
      qz::copy_columns(stage, qz::v_thread(), w);
      for (int e = 0; e < 16; ++e) reads[t * 16 + e] = w[e].x;
    }
  }
}

extern "C" void e4m3_bytes(const float* x, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(qz::emulated_e4m3(x[i]));
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    emu = bt.build_host_library(tmp_path_factory.mktemp("quantize_emulator"), "emulate_quantize",
                                EMULATOR_SOURCE, pthread=True)
    emu.check_e2m1_top_nibble.restype = ctypes.c_int64
    emu.check_e2m1_top_nibble.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    emu.check_div6.restype = ctypes.c_int64
    emu.check_div6.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    emu.check_e2m1_value.restype = ctypes.c_int64
    emu.check_e2m1_value.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
    emu.v_staging_offsets.restype = None
    emu.v_staging_offsets.argtypes = [ctypes.c_void_p] * 3
    emu.quantize_groups_fp16.restype = ctypes.c_int64
    emu.quantize_groups_fp16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    emu.quantize_groups.restype = ctypes.c_int64
    emu.quantize_groups.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2
    emu.e4m3_bytes.restype = None
    emu.e4m3_bytes.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    emu.emulate_quantize.restype = ctypes.c_int
    emu.emulate_quantize.argtypes = (
        [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int]
        + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    )
    return emu


def _in_halves(fn, begin: int, end: int) -> list[int]:
    """fn over [begin, end) split in two threads (ctypes releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    mid = (begin + end) // 2
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda r: fn(*r), [(begin, mid), (mid, end)]))


@pytest.mark.nvcc
def test_emulated_e4m3_matches_formats(emulator) -> None:
    torch = pytest.importorskip("torch")
    from flashinfer_h3 import formats as F

    bits = torch.cat([torch.arange(0, 0x44800000, 61, dtype=torch.int64),  # |x| <= 1024, dense
                      torch.arange(0x44800000, 0x7F800001, 997, dtype=torch.int64)])
    x = torch.cat([bits, bits | (1 << 31)]).to(torch.int32).view(torch.float32)
    got = torch.empty(x.numel(), dtype=torch.uint8)
    emulator.e4m3_bytes(x.data_ptr(), x.numel(), got.data_ptr())
    assert torch.equal(got, F.rn_e4m3(x))


@pytest.mark.nvcc
def test_e2m1_encoder_every_float(emulator) -> None:
    # Every y' with |y'| < 2^-95 (|x r| < 2^15, the range the fast path is used for).
    assert _in_halves(emulator.check_e2m1_top_nibble, 0, 0x10000000) == [0, 0]


@pytest.mark.nvcc
def test_div6_every_float(emulator) -> None:
    assert all(r >= 0 for r in _in_halves(emulator.check_div6, 0, 0x7F800000))


@pytest.mark.nvcc
def test_e2m1_value_every_float(emulator) -> None:
    """The FP16 policy's element (e2m1_value) on all 2^32 float patterns: zeros, subnormals,
    normals, ties, saturation, inf and NaN, both signs."""
    results = _in_halves(emulator.check_e2m1_value, 0, 1 << 32)
    bad = [-r - 1 for r in results if r < 0]
    assert not bad, f"first failing pattern 0x{bad[0]:08x}"


def _adversarial_groups(n: int) -> dict:
    """Groups of 16 of every kind the group quantizer must get right (FP32 [n, 16] each)."""
    torch = pytest.importorskip("torch")
    from flashinfer_h3 import formats as F

    g = torch.Generator().manual_seed(0)
    e4m3_values = F.e4m3_to_float(torch.arange(1, 127, dtype=torch.uint8))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,  # E2M1 midpoints (times s)
                         0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    scale = e4m3_values[torch.randint(0, 126, (n, 1), generator=g)]
    tie_groups = scale * ties[torch.randint(0, 15, (n, 16), generator=g)]
    # amax / 6 exactly on the scale, or near it (the scale then rounds up or down)
    near = torch.tensor([1.0, 1.03, 0.97, 1.0625])[torch.randint(0, 4, (n,), generator=g)]
    tie_groups[:, 0] = scale[:, 0] * 6 * near
    tie_groups *= torch.where(torch.rand(n, 16, generator=g) < 0.5, -1.0, 1.0)
    specials = torch.randn(n, 16, generator=g)
    specials[torch.rand(n, 16, generator=g) < 0.1] = 0.0
    specials[torch.rand(n, 16, generator=g) < 0.05] = -0.0
    specials[torch.rand(n, generator=g) < 0.1] = -0.0
    specials[torch.rand(n, 16, generator=g) < 0.01] = 3e38
    nans = torch.randn(n, 16, generator=g)
    nans[torch.rand(n, 16, generator=g) < 0.1] = float("nan")
    nans[torch.rand(n, 16, generator=g) < 0.05] = float("inf")
    nans[torch.rand(n, 16, generator=g) < 0.05] = -float("inf")
    nans[torch.rand(n, generator=g) < 0.05] = float("nan")  # all-NaN groups (scale 448)
    return {
        "gaussian": torch.randn(n, 16, generator=g),
        "decades": torch.randn(n, 16, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 8),
        "wide": torch.randn(n, 16, generator=g)
        * torch.exp(torch.empty(n, 1).uniform_(-80, 80, generator=g)),
        "ties": tie_groups,
        "specials": specials,
        "non-finite": nans,
    }


@pytest.mark.nvcc
def test_group_quantizer_matches_formats(emulator) -> None:
    torch = pytest.importorskip("torch")
    from flashinfer_h3 import formats as F

    n = 100_000
    for kind, x in _adversarial_groups(n).items():
        if kind == "non-finite":
            # NaN elements: the kernel's amax tree leaves them out (fmaxf) where formats.py and
            # the reference steps propagate or zero them; no contract covers NaN inputs. The
            # FP16 policy is held to the kernel's own codes on them (next test).
            continue
        x = x.float().contiguous()
        codes = torch.empty(n, 8, dtype=torch.uint8)
        scales = torch.empty(n, dtype=torch.uint8)
        differ = emulator.quantize_groups(x.data_ptr(), n, codes.data_ptr(), scales.data_ptr())
        assert differ == 0, f"{kind}: {differ} groups differ from formats.cuh's steps"
        want_codes, want_scales = F.nvfp4_quantize(x)
        assert torch.equal(scales, want_scales.view(-1)), f"{kind}: scales differ from formats.py"
        assert torch.equal(codes, want_codes), f"{kind}: codes differ from formats.py"


@pytest.mark.nvcc
def test_fp16_groups_are_the_decoded_codes(emulator) -> None:
    """nvfp4_group_fp16 (the FP16 policy) against nvfp4_group's codes decoded as the expansion
    decoded them (in C, every kind, non-finite inputs included) and against formats.py's
    quantize-dequantize rounded to FP16 (torch), bit for bit: signed zeros, zero scales,
    saturation."""
    torch = pytest.importorskip("torch")
    from flashinfer_h3 import formats as F

    n = 100_000
    for kind, x in _adversarial_groups(n).items():
        x = x.float().contiguous()
        got = torch.empty(n, 8, dtype=torch.int32)
        differ = emulator.quantize_groups_fp16(x.data_ptr(), n, got.data_ptr())
        assert differ == 0, f"{kind}: {differ} groups differ from the decoded codes"
        if kind == "non-finite":
            continue
        want = F.nvfp4_dequantize(*F.nvfp4_quantize(x)).half()  # [n, 16]
        assert torch.equal(got.view(torch.int16).view(n, 16), want.view(torch.int16)), kind


@pytest.mark.nvcc
def test_fp16_v_staging_layout(emulator) -> None:
    """The FP16 policy's V staging (prepass.cuh, nvfp4_v_fp16), on the header's own address
    functions: each warp stores into exactly the bytes its lanes' copy_columns read (so it needs
    no CTA barrier: no other warp reads them), every staged word once; each copy-out load reads
    the 16 bytes of positions 8 cx .. 8 cx + 7 of its row, the 4 words the 4 lanes of that chunk
    stored; stores and loads are free of bank conflicts (32 banks of 4 bytes; a 16-byte load
    is served 8 lanes at a time)."""
    torch = pytest.importorskip("torch")
    stores = torch.zeros(8, 32, 4, 8, dtype=torch.int64)
    loads = torch.zeros(8, 32, 8, dtype=torch.int64)
    reads = torch.zeros(8, 32, 16, dtype=torch.int64)
    s32, l32, r32 = (torch.zeros(t.shape, dtype=torch.int32) for t in (stores, loads, reads))
    emulator.v_staging_offsets(s32.data_ptr(), l32.data_ptr(), r32.data_ptr())
    stores, loads, reads = (t.to(torch.int64) for t in (s32, l32, r32))
    for warp in range(8):
        own = {int(b) + 4 * half for b in reads[warp].flatten() for half in (0, 1)}  # 4-byte words
        staged = [int(b) for b in stores[warp].flatten()]
        assert len(staged) == len(set(staged)) == 1024, f"warp {warp}: a word staged twice"
        assert set(staged) == own, f"warp {warp}: stages outside the bytes it read"
        for k in range(4):
            for i in range(8):
                banks = (stores[warp, :, k, i] // 4) % 32
                assert len(set(banks.tolist())) == 32, f"warp {warp}: store ({k}, {i}) conflicts"
        for jj in range(8):
            for quarter in range(4):
                lanes = range(8 * quarter, 8 * quarter + 8)
                groups = {(int(loads[warp, lane, jj]) // 16) % 8 for lane in lanes}
                assert len(groups) == 8, f"warp {warp}: load {jj} conflicts"
            for lane in range(32):
                # chunk cx = lane % 8 of row 4 jj + lane / 8: stored by lanes (u = jj, t) at
                # (k = lane / 8, i = cx), word t at byte 4 t of the chunk
                want = [int(stores[warp, jj + 8 * t, lane // 8, lane % 8]) for t in range(4)]
                got = int(loads[warp, lane, jj])
                assert got % 16 == 0 and want == [got + 4 * t for t in range(4)], (warp, lane, jj)


# Lengths 0, 1, 15, 16, 1, 0, 63, 64, 65, 127, 128, 129, 0, 0, 255, 256, 257, 2, 300.
_EDGE_BOUNDS = [0, 0, 1, 16, 32, 33, 33, 96, 160, 225, 352, 480, 609, 609, 609, 864, 1120, 1377,
                1379, 1679]
# Lengths 1, 15, 16, 17, 0, 63, 64, 65, 127, 128, 129, 0, 2, 300.
_FP16_BOUNDS = [0, 1, 16, 32, 49, 49, 112, 176, 241, 368, 496, 625, 625, 627, 927]


def _run_emulated(emulator, op: str, q, k, v, bounds: list[int], grid: int, copy_mode: int,
                  stages: int, with_q: bool = True) -> tuple[Any, Any, Any, Any]:
    """The emulated launches of ``op``'s pre-pass (``with_q = False``: FP8 without its Q items)
    into a poisoned workspace: (views, workspace, layout, host plan)."""
    import torch
    from test_quantize_gpu import POISON, TAIL_BYTES, layout_of, operand_regions

    from flashinfer_h3.plan import build_host_plan

    T, H, S = bounds[-1], q.shape[1], len(bounds) - 1
    layout = layout_of(op, T, H, S)
    host = build_host_plan(bounds)
    flat = torch.tensor(host.flat_tables(), dtype=torch.int32)
    n = S + 1
    tables = [flat[0:n], flat[n : 2 * n], flat[2 * n : 3 * n], flat[3 * n :]]
    ws = torch.full((layout.total_bytes + TAIL_BYTES,), POISON, dtype=torch.uint8)
    views = layout.views(ws)
    pointers = [views[name].data_ptr() for name in operand_regions(op, layout)]
    regions = (ctypes.c_void_p * len(pointers))(*pointers)
    v_code_row = views["v_f16" if op == "nvfp4_fp16" else "v_codes"].shape[2]  # FP16: vkeys_cap
    k_scale_row = views["k_scales"].shape[1] if op == "fp8" else 0
    code = {"nvfp4": 0, "fp8": 1, "nvfp4_fp16": 2}[op] if with_q else 3
    assert with_q or op == "fp8", "only the FP8 pre-pass runs without Q"
    rc = emulator.emulate_quantize(
        code, q.data_ptr(), k.data_ptr(), v.data_ptr(), T, H, *[t.data_ptr() for t in tables], S,
        host.num_qblocks, regions, v_code_row, k_scale_row, grid, copy_mode, stages,
    )
    assert rc == 0
    return views, ws, layout, host


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize(("bounds", "heads", "grid"), [(_EDGE_BOUNDS, 3, 7), ([0, 640], 13, 1)],
                         ids=["edges", "one-cta"])
def test_emulated_fp8_launches_without_q(emulator, bounds: list[int], heads: int,
                                        grid: int) -> None:
    """The FP8 pre-pass for a kernel that quantises Q itself (launch_quantize's kWithQ = false,
    Pass::kStats): the Q regions stay as they were (poisoned here), everything else is the
    reference's bit for bit, as with Q (check_call, with the reference's Q filled in)."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_quantize_gpu import assert_poisoned, check_call, make_qkv

    from flashinfer_h3 import reference as R

    q, k, v = make_qkv(bounds[-1], heads, "biased", seed=heads, device="cpu")
    views, ws, layout, host = _run_emulated(emulator, "fp8", q, k, v, bounds, grid, 0, 3,
                                            with_q=False)
    assert_poisoned(views["q_codes"], "q_codes")
    assert_poisoned(views["q_scales"], "q_scales")
    ref = R.fp8_quantize_stages(q, k, v, bounds)
    views["q_codes"].copy_(ref["q_codes"])
    views["q_scales"].copy_(ref["q_scales"])
    check_call("fp8", views, ws, layout, host, q, k, v)


@pytest.mark.nvcc
@pytest.mark.slow
@pytest.mark.parametrize(
    "op,bounds,heads,kind,grid,copy_mode,stages",
    [
        ("nvfp4", _EDGE_BOUNDS, 3, "biased", 7, 0, 3),
        ("fp8", _EDGE_BOUNDS, 3, "biased", 7, 0, 3),
        ("nvfp4", _EDGE_BOUNDS, 3, "heavy", 5, 1, 3),  # copies land at the issue
        ("fp8", _EDGE_BOUNDS, 3, "heavy", 5, 1, 3),
        ("fp8", _EDGE_BOUNDS, 3, "tiny", 7, 0, 3),  # FP8 scales below 2^-126: flushed
        ("nvfp4", _EDGE_BOUNDS, 3, "tiny", 7, 0, 3),
        ("nvfp4", _EDGE_BOUNDS, 2, "gaussian", 4, 0, 2),  # the SM120 ring
        ("fp8", _EDGE_BOUNDS, 2, "gaussian", 4, 0, 2),
        ("nvfp4", [0, 640], 13, "gaussian", 1, 0, 3),  # one CTA walks every item
        ("fp8", [0, 640], 13, "gaussian", 1, 0, 3),
        ("nvfp4", [0, 130, 135, 135, 300], 64, "heavy", 50, 0, 3),
        ("nvfp4", [0, 16384], 1, "biased", 264, 0, 3),  # launch 2 split over 4 CTAs
        ("fp8", [0, 16384], 1, "biased", 264, 0, 3),
        # The FP16 policy: window order, zero padding, the V staging; empty segments, lengths
        # 1, 15-17, 63-65, 127-129, several heads.
        ("nvfp4_fp16", _FP16_BOUNDS, 3, "biased", 7, 0, 3),
        ("nvfp4_fp16", _FP16_BOUNDS, 2, "heavy", 5, 1, 3),  # copies land at the issue
        ("nvfp4_fp16", _FP16_BOUNDS, 3, "tiny", 7, 0, 3),
        ("nvfp4_fp16", _FP16_BOUNDS, 2, "gaussian", 4, 0, 2),
        ("nvfp4_fp16", [0, 640], 13, "gaussian", 1, 0, 3),  # one CTA walks every item
        ("nvfp4_fp16", [0, 130, 135, 135, 300], 64, "heavy", 50, 0, 3),
        ("nvfp4_fp16", [0, 16384], 1, "biased", 264, 0, 3),
    ],
)
def test_emulated_launches_match_reference(
    emulator, op: str, bounds: list[int], heads: int, kind: str, grid: int, copy_mode: int,
    stages: int,
) -> None:
    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_quantize_gpu import check_call, make_qkv

    q, k, v = make_qkv(bounds[-1], heads, kind, seed=len(bounds) + heads, device="cpu")
    views, ws, layout, host = _run_emulated(emulator, op, q, k, v, bounds, grid, copy_mode, stages)
    check_call(op, views, ws, layout, host, q, k, v)
