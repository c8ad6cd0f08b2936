"""CPU checks of the mma.sync FP8 attention kernel's compiled form (SPEC 6, SM120 row).

The fp8 module (pre-pass + ``attention_fp8_mma_sync``) is built through the JIT for sm_120a and
sm_90a and read back from the binary (no GPU needed; nvcc and cuobjdump are):

- sm_120a: at most 255 registers, no stack, no local memory, no spills (ptxas report); built for
  exactly 256 threads per CTA; dynamic shared memory (``attention_fp8_mma_sync_smem_bytes``)
  <= 99 KB and, with the static part, one CTA per SM of an RTX 5090;
- sm_120a SASS: 64 ``QMMA.16832.F32.E4M3.E4M3`` per 64-key tile, i.e. both products on the FP8
  tensor cores (QK^T: 8 n8 key tiles x 4 k32 steps; PV: 16 n8 channel tiles x 2 k32 steps), the
  P operand packed with ``F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C``, and no HMMA;
- sm_90a: the same source; no stack, local memory or spills; ptxas lowered every E4M3 mma.sync to
  F16 unpacks + two HMMA.16816.F32 (128 per tile), no QMMA.
"""

from __future__ import annotations

from pathlib import Path

import binary_tools as bt
import pytest

KERNEL = "attention_fp8_kernel"
ARCHS = ("sm_120a", "sm_90a")
MAX_REGISTERS = 255
THREADS = 256
MAX_DYNAMIC_SMEM = 99 * 1024  # RTX 5090: 99 KB opt-in per block
SM_SMEM = 100 * 1024  # shared memory of one SM120 SM
QMMA = "QMMA.16832.F32.E4M3.E4M3"
QMMA_PER_TILE = 8 * 4 + 16 * 2  # QK^T + PV of one 64-key tile
P_PACK = "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"


@pytest.fixture(scope="module")
def builds() -> dict[str, Path]:
    from flashinfer_h3.jit import KernelConfig, build_module

    return {arch: Path(build_module(KernelConfig("fp8", arch=arch))) for arch in ARCHS}


@pytest.mark.nvcc
def test_sm120a_resources(builds: dict[str, Path]) -> None:
    so = builds["sm_120a"]
    res = bt.resources(so, KERNEL)
    print(f"[sm_120a] {KERNEL}: {res}")
    assert res["REG"] <= MAX_REGISTERS
    assert res["STACK"] == 0 and res["LOCAL"] == 0
    assert "0 bytes spill stores, 0 bytes spill loads" in bt.ptxas_report(so, KERNEL)
    assert bt.max_threads(so, KERNEL) == (THREADS, 1, 1)
    dynamic = int(bt.load(so).attention_fp8_mma_sync_smem_bytes())
    print(f"[sm_120a] dynamic shared memory {dynamic} B, static {res['SHARED']} B")
    assert 0 < dynamic <= MAX_DYNAMIC_SMEM
    assert dynamic + res["SHARED"] <= SM_SMEM


@pytest.mark.nvcc
def test_sm120a_both_products_on_fp8_tensor_cores(builds: dict[str, Path]) -> None:
    sass = bt.sass(builds["sm_120a"], KERNEL)
    assert sass.count(QMMA) == QMMA_PER_TILE
    assert sass.count(P_PACK) >= 16  # 32 P codes per lane and tile, two per cvt
    assert "HMMA" not in sass
    assert "LDL" not in sass and "STL" not in sass


@pytest.mark.nvcc
def test_sm90a_same_source_lowered_by_ptxas(builds: dict[str, Path]) -> None:
    so = builds["sm_90a"]
    res = bt.resources(so, KERNEL)
    print(f"[sm_90a] {KERNEL}: {res}")
    assert res["REG"] <= MAX_REGISTERS
    assert res["STACK"] == 0 and res["LOCAL"] == 0
    assert "0 bytes spill stores, 0 bytes spill loads" in bt.ptxas_report(so, KERNEL)
    sass = bt.sass(so, KERNEL)
    assert "QMMA" not in sass
    assert sass.count("HMMA.16816.F32") == 2 * QMMA_PER_TILE
    assert "F2FP.F16.E4M3.UNPACK_B" in sass
    assert "LDL" not in sass and "STL" not in sass


@pytest.mark.nvcc
def test_module_exports(builds: dict[str, Path]) -> None:
    mod = bt.load(builds["sm_120a"])
    for name in ("quantize_fp8", "attention_fp8_mma_sync", "attention_fp8_mma_sync_smem_bytes"):
        assert hasattr(mod, name), name


def test_template_renders_clean() -> None:
    from flashinfer_h3.jit import KernelConfig, render_template

    text = render_template("attention_fp8_mma_sync.cu.jinja",
                           KernelConfig("fp8", arch="sm_120a").template_context())
    assert "{{" not in text and "{%" not in text
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(attention_fp8_mma_sync," in text
    assert "use_fast_math" not in text
