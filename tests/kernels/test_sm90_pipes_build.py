"""CPU checks of ``benchmarks/sm90_pipes.cu``, the cycle microbenchmarks of the Hopper kernels'
parts (no GPU needed; nvcc and cuobjdump are).

The program times the kernels' own device functions, so a header change can break it without
anyone running it; and its numbers mean something only if the compiled loops do the work: ptxas
replaces a wgmma whose accumulators nothing reads with an empty ``HGMMA.64x8x16 RZ`` and would
remove softmax work whose results are dead. Checked here:

- it builds for sm_90a with no local memory (0 bytes of stack and spills in ptxas' report);
- every wgmma in its SASS is a full-size one (``QGMMA.64x128x32`` / ``HGMMA.64x128x16``, and the
  64-key tiles' ``HGMMA.64x64x16``), none emptied;
- the FP8 softmax experiment's loop holds the 60 exponentials (MUFU.EX2) of a tile;
- the "nvfp4 loop" consumer tile loops (``loop_kernel``: 2 consumers on 128-key tiles, 3 on 64-key
  tiles) keep their wgmmas asynchronous: no ptxas serialisation note (C7510-C7519) for them, one
  ``WARPGROUP.ARRIVE`` per commit group (PV, QK^T) and one wait per tile, and the 3 x 64 loop
  holds its 4 PV and 8 QK^T wgmmas of the right shapes and its 32 + 4 exponentials.
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
    shapes = {"QGMMA.64x128x32", "HGMMA.64x128x16", "HGMMA.64x64x16"}
    assert set(wgmmas) <= shapes, sorted(set(wgmmas))


def test_fp8_softmax_loop_keeps_its_exponentials(built: tuple[Path, str]) -> None:
    exe, _ = built
    sass = bt.cuobjdump("--dump-sass", str(exe))
    # The FP8 softmax experiment alone: pipes_kernel<kFp8Softmax = 4, kIdle = 0, false>.
    blocks = re.split(r"\n\s*Function : ", sass)
    mine = [b for b in blocks if "pipes_kernelILi4ELi0ELb0E" in b.split("\n", 1)[0]]
    assert len(mine) == 1
    assert mine[0].count("MUFU.EX2") >= 60


# loop_kernel<consumers, active, keys, role> (mangled ILi<c>ELi<a>ELi<k>ELi<role>E); LoopRole
# kLoopTurn = 0, kLoopFree = 1.
LOOPS = {
    "2x128 ping-pong": "loop_kernelILi2ELi2ELi128ELi0E",
    "2x128 unordered": "loop_kernelILi2ELi2ELi128ELi1E",
    "3x64 round-robin": "loop_kernelILi3ELi3ELi64ELi0E",
    "3x64 unordered": "loop_kernelILi3ELi3ELi64ELi1E",
}


def _kernel_sass(sass: str, mangled: str) -> str:
    blocks = re.split(r"\n\s*Function : ", sass)
    mine = [b for b in blocks if mangled in b.split("\n", 1)[0]]
    assert len(mine) == 1, mangled
    return mine[0]


def test_consumer_loops_keep_wgmmas_asynchronous(built: tuple[Path, str]) -> None:
    exe, report = built
    # ptxas' notes C7510-C7519 name the wgmmas it serialised or the waits it injected.
    notes = re.findall(r"\(C751\d\)[^\n]*'(\S+)'", report)
    serialised = [name for name in notes if "loop_kernel" in name]
    assert not serialised, serialised
    sass = bt.cuobjdump("--dump-sass", str(exe))
    for what, mangled in LOOPS.items():
        body = _kernel_sass(sass, mangled)
        # Straight-line tile loop: PV and QK^T each behind one wgmma.fence, one wait for both.
        assert body.count("WARPGROUP.ARRIVE") == 2, what
        assert body.count("WARPGROUP.DEPBAR") == 1, what
        assert "LDL" not in body and "STL" not in body, what


def test_three_consumer_loop_shapes(built: tuple[Path, str]) -> None:
    exe, _ = built
    body = _kernel_sass(bt.cuobjdump("--dump-sass", str(exe)), LOOPS["3x64 round-robin"])
    assert len(re.findall(r"HGMMA\.64x64x16\b", body)) == 8  # QK^T: 8 k16 steps over 128 channels
    assert len(re.findall(r"HGMMA\.64x128x16\b", body)) == 4  # PV: 4 k16 steps over 64 keys
    # 32 exponentials of the scores, 2 of alpha, 2 group scales (one 16-key group a row).
    assert body.count("MUFU.EX2") >= 36
    assert re.search(r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x100", body)  # the turn
    assert re.search(r"BAR\.ARV R\d+, 0x100", body)
