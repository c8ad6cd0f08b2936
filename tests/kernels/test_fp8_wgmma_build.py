"""CPU checks of the Hopper wgmma FP8 kernel's compiled form (module ``fp8_wgmma``, sm_90a).

Built through the JIT (no GPU needed; nvcc and cuobjdump are), read back from the binary:

- both products on the FP8 wgmma: 8 ``QGMMA.64x128x32.F32.E4M3.E4M3`` with both operands in
  shared memory (QK^T, 4 k32 steps) and 8 with A = P from registers (PV) per consumer
  warpgroup's code path (the two consumers are separate instantiations), no HGMMA/HMMA;
- the roles' register split (``USETMAXREG``), 384 threads, one CTA per SM of shared memory;
- the local-memory use that remains: ptxas keeps four item-setup values of consumer 1 in 16
  bytes of stack (read once per 128-row item, never in the tile loop). The issue asks for none;
  this test pins the figure so that any growth (a spill in the tile loop) fails it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.nvcc

KERNEL = "attention_fp8_wgmma_kernel"
QGMMA = "QGMMA.64x128x32.F32.E4M3.E4M3"
MAX_SMEM = 227 * 1024  # H100/H200 opt-in per block
MAX_SPILL_BYTES = 16


def _cuobjdump(*args: str) -> str:
    exe = shutil.which("cuobjdump")
    if exe is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or pip nvidia-cuda-cuobjdump)")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def so() -> Path:
    from flashinfer_h3.jit import KernelConfig, build_module

    return Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a")))


def _sass(so: Path) -> str:
    blocks = re.split(r"\n\s*Function : ", _cuobjdump("--dump-sass", str(so)))
    mine = [b for b in blocks if KERNEL in b.split("\n", 1)[0]]
    assert len(mine) == 1, f"expected one SASS function named *{KERNEL}*, found {len(mine)}"
    return mine[0]


def _ptxas_report(so: Path) -> str:
    text = (so.parent / "build.log").read_text()
    m = re.search(r"Compiling entry function '\S*" + KERNEL + r"\S*'.*?\n(.*?Used \d+ registers)",
                  text, re.S)
    assert m, f"no ptxas report of {KERNEL} in the build log"
    return m.group(1)


def test_both_products_on_fp8_wgmma(so: Path) -> None:
    sass = _sass(so)
    ss = [line for line in sass.splitlines() if QGMMA in line and "gdesc" in line.split(QGMMA)[1]
          and re.search(QGMMA + r" R\d+, gdesc", line)]
    rs = [line for line in sass.splitlines() if re.search(QGMMA + r" R\d+, R\d+, gdesc", line)]
    print(f"{KERNEL}: {len(ss)} SS (QK^T) and {len(rs)} RS (PV) FP8 wgmma")
    # Each consumer instantiation: QK^T in the first phase and in the loop, PV in the loop and in
    # the last phase, 4 k32 steps each.
    assert len(ss) == 2 * 2 * 4 and len(rs) == 2 * 2 * 4
    assert "HGMMA" not in sass and "HMMA" not in sass
    assert "USETMAXREG" in sass


def test_resources(so: Path) -> None:
    report = _ptxas_report(so)
    print(report)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    assert spills and max(spills) <= MAX_SPILL_BYTES, report
    import tvm_ffi

    smem = int(tvm_ffi.load_module(str(so)).attention_fp8_wgmma_smem_bytes())
    assert 0 < smem <= MAX_SMEM


def test_module_is_hopper_only() -> None:
    from flashinfer_h3.jit import KernelConfig

    with pytest.raises(ValueError, match="sm_90a"):
        KernelConfig("fp8_wgmma", arch="sm_120a")
