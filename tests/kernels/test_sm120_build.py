"""CPU checks of the NVFP4 attention kernel's compiled form (SPEC 6, SM120 row).

The nvfp4 module is built through the JIT for sm_120a (native FP4 MMA) and sm_90a (the emulated
MMA layer), then read back from the binary:

- sm_120a, ``cuobjdump --dump-resource-usage``: at most 255 registers, no stack, no local memory;
  the ptxas report: no spills; ``cuobjdump -elf``: the kernel is built for exactly 256 threads
  per CTA; its dynamic shared memory (the module's ``attention_nvfp4_smem_bytes``) plus the
  static part fits one CTA per SM of an RTX 5090 (99 KB per block);
- sm_120a, ``--dump-sass``: the attention kernel issues 64 ``OMMA.SF.16864...UE4M3.4X``, i.e.
  both products (QK^T and PV, 2 k64 steps x 16 n8 tiles each) run on the block-scaled FP4
  tensor cores, and no HMMA;
- sm_90a: no stack, local memory or spills either, and the products are HMMA (no OMMA).

Needs nvcc (and cuobjdump, from the CUDA toolkit or the pip ``nvidia-cuda-cuobjdump``), no GPU.
"""

from __future__ import annotations

from pathlib import Path

import binary_tools as bt
import pytest

KERNEL = "attention_nvfp4_kernel"
ARCHS = ("sm_120a", "sm_90a")
MAX_REGISTERS = 255
THREADS = 256
MAX_DYNAMIC_SMEM = 99 * 1024  # RTX 5090: 99 KB opt-in per block, one CTA per SM
SM_SMEM = 100 * 1024  # shared memory of one SM120 SM
OMMA = "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X"
OMMA_PER_TILE = 2 * 2 * 16  # (QK^T, PV) x 2 k64 steps x 16 n8 tiles


@pytest.fixture(scope="module")
def builds() -> dict[str, Path]:
    from flashinfer_h3.jit import KernelConfig, build_module

    return {arch: Path(build_module(KernelConfig("nvfp4", arch=arch))) for arch in ARCHS}


@pytest.mark.nvcc
def test_sm120a_resources(builds: dict[str, Path]) -> None:
    so = builds["sm_120a"]
    res = bt.resources(so, KERNEL)
    print(f"[sm_120a] {KERNEL}: {res}")
    assert res["REG"] <= MAX_REGISTERS
    assert res["STACK"] == 0
    assert res["LOCAL"] == 0
    assert "0 bytes spill stores, 0 bytes spill loads" in bt.ptxas_report(so, KERNEL)
    assert bt.max_threads(so, KERNEL) == (THREADS, 1, 1)
    dynamic = int(bt.load(so).attention_nvfp4_smem_bytes())
    print(f"[sm_120a] dynamic shared memory {dynamic} B, static {res['SHARED']} B")
    assert 0 < dynamic <= MAX_DYNAMIC_SMEM
    assert dynamic + res["SHARED"] <= SM_SMEM


@pytest.mark.nvcc
def test_sm120a_both_products_on_fp4_tensor_cores(builds: dict[str, Path]) -> None:
    sass = bt.sass(builds["sm_120a"], KERNEL)
    assert sass.count(OMMA) == OMMA_PER_TILE
    assert "HMMA" not in sass
    assert "LDL" not in sass and "STL" not in sass


@pytest.mark.nvcc
def test_sm90a_emulation_builds_without_local_memory(builds: dict[str, Path]) -> None:
    so = builds["sm_90a"]
    res = bt.resources(so, KERNEL)
    print(f"[sm_90a] {KERNEL}: {res}")
    assert res["STACK"] == 0
    assert res["LOCAL"] == 0
    assert "0 bytes spill stores, 0 bytes spill loads" in bt.ptxas_report(so, KERNEL)
    sass = bt.sass(so, KERNEL)
    assert "OMMA" not in sass
    assert "HMMA.16816.F32" in sass


@pytest.mark.nvcc
def test_module_exports(builds: dict[str, Path]) -> None:
    mod = bt.load(builds["sm_120a"])
    for name in ("quantize_nvfp4", "attention_nvfp4", "attention_nvfp4_smem_bytes"):
        assert hasattr(mod, name), name
    # The MMA probe is test-only: its own module (nvfp4_mma_probe), never in the production .so.
    assert not hasattr(mod, "mma_nvfp4_probe")


@pytest.mark.nvcc
def test_probe_module_holds_only_the_probe() -> None:
    from flashinfer_h3.jit import KernelConfig, build_module

    so = build_module(KernelConfig("nvfp4_mma_probe", arch="sm_120a"))
    mod = bt.load(so)
    assert hasattr(mod, "mma_nvfp4_probe") and not hasattr(mod, "attention_nvfp4")
    sass = bt.cuobjdump("--dump-sass", str(so))
    assert "mma_probe_kernel" in sass and "attention_nvfp4_kernel" not in sass
    assert "OMMA" in sass  # the native layer on sm_120a


def test_template_renders_clean() -> None:
    from flashinfer_h3.jit import KernelConfig, render_template

    text = render_template("attention_nvfp4.cu.jinja",
                           KernelConfig("nvfp4", arch="sm_120a").template_context())
    assert "{{" not in text and "{%" not in text
    assert "TVM_FFI_DLL_EXPORT_TYPED_FUNC(attention_nvfp4," in text
    assert "use_fast_math" not in text
