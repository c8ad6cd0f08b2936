"""CPU checks of ``benchmarks/sm90_pipes.cu``, the cycle microbenchmarks of the Hopper kernels'
parts (no GPU needed; nvcc and cuobjdump are).

The program times the kernels' own device functions, so a header change can break it without
anyone running it; and its numbers mean something only if the compiled loops do the work: ptxas
replaces a wgmma whose accumulators nothing reads with an empty ``HGMMA.64x8x16 RZ`` and would
remove softmax work whose results are dead. Checked here:

- it builds for sm_90a with no local memory (0 bytes of stack and spills in ptxas' report);
- every wgmma in its SASS is a full-size one (``QGMMA.64x128x32`` / ``HGMMA.64x128x16``), none
  emptied;
- the FP8 softmax experiment's loop holds the 60 exponentials (MUFU.EX2) of a tile.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import binary_tools as bt
import pytest

pytestmark = pytest.mark.nvcc

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "benchmarks" / "sm90_pipes.cu"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    from flashinfer_h3.jit import find_nvcc
    from flashinfer_h3.jit.env import include_dir

    nvcc = find_nvcc()
    assert nvcc is not None  # the nvcc marker skips without one
    exe = tmp_path_factory.mktemp("sm90_pipes") / "sm90_pipes"
    cmd = [str(nvcc), "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
           f"-I{include_dir()}", "-Xptxas", "-v", str(SOURCE), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return exe, done.stderr


def test_builds_without_local_memory(built: tuple[Path, str]) -> None:
    _, report = built
    frames = re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report
    )
    assert len(frames) >= 10, report[-2000:]  # one per experiment kernel
    assert all(f == ("0", "0", "0") for f in frames), report[-2000:]


def test_every_wgmma_is_full_size(built: tuple[Path, str]) -> None:
    exe, _ = built
    sass = bt.cuobjdump("--dump-sass", str(exe))
    wgmmas = re.findall(r"\b([QH]GMMA\.\d+x\d+x\d+)", sass)
    assert wgmmas, "no wgmma in the SASS"
    assert set(wgmmas) <= {"QGMMA.64x128x32", "HGMMA.64x128x16"}, sorted(set(wgmmas))


def test_fp8_softmax_loop_keeps_its_exponentials(built: tuple[Path, str]) -> None:
    exe, _ = built
    sass = bt.cuobjdump("--dump-sass", str(exe))
    # The FP8 softmax experiment alone: pipes_kernel<kFp8Softmax = 4, kIdle = 0, false>.
    blocks = re.split(r"\n\s*Function : ", sass)
    mine = [b for b in blocks if "pipes_kernelILi4ELi0ELb0E" in b.split("\n", 1)[0]]
    assert len(mine) == 1
    assert mine[0].count("MUFU.EX2") >= 60
