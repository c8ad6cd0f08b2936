"""benchmarks/ptxas_release_builds.py: the shim toolkit that puts another CUDA release's ptxas
behind nvcc's front end (CPU only, fake tools: no nvcc needed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the shim is a bash script")


def _script() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ptxas_release_builds.py"
    spec = importlib.util.spec_from_file_location("ptxas_release_builds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture()
def toolkit(tmp_path: Path) -> Path:
    """A fake nvcc toolkit: bin/{nvcc, ptxas, cudafe++} and include/."""
    top = tmp_path / "cuda"
    (top / "bin").mkdir(parents=True)
    (top / "include").mkdir()
    (top / "include" / "cuda.h").write_text("/* fake */\n")
    _executable(top / "bin" / "nvcc", "#!/bin/sh\necho real nvcc\n")
    _executable(top / "bin" / "ptxas", "#!/bin/sh\necho nvcc's own ptxas\n")
    _executable(top / "bin" / "cudafe++", "#!/bin/sh\n")
    return top


def test_shim_hands_lowered_ptx_and_every_argument_to_the_other_ptxas(tmp_path: Path,
                                                                     toolkit: Path) -> None:
    script = _script()
    # The "other release": prints the .version line of the PTX it got, then its arguments.
    other = _executable(tmp_path / "other_ptxas", (
        "#!/bin/bash\n"
        "for a in \"$@\"; do\n"
        "  if [[ $a == *.ptx ]]; then grep '^\\.version' \"$a\"; else echo \"arg:$a\"; fi\n"
        "done\n"))
    root = tmp_path / "shim"
    root.mkdir()
    nvcc = script.make_shim(root, toolkit / "bin", other, "8.5")

    assert nvcc == root / "bin" / "nvcc"
    assert nvcc.is_file() and not nvcc.is_symlink()  # a copy: nvcc finds its tools beside it
    assert (root / "bin" / "cudafe++").resolve() == (toolkit / "bin" / "cudafe++").resolve()
    assert (root / "include" / "cuda.h").read_text() == "/* fake */\n"
    shim = root / "bin" / "ptxas"
    assert os.access(shim, os.X_OK) and not shim.is_symlink()

    ptx = tmp_path / "kernel.ptx"
    original = "//\n.version 9.0\n.target sm_90a\n.visible .entry k() { ret; }\n"
    ptx.write_text(original)
    run = subprocess.run([str(shim), "-arch=sm_90a", str(ptx), "-o", str(tmp_path / "a b.cubin")],
                         capture_output=True, text=True, check=True)
    assert run.stdout.splitlines() == [
        "arg:-arch=sm_90a", ".version 8.5", "arg:-o", f"arg:{tmp_path / 'a b.cubin'}"]
    assert "ptxas shim:" in run.stderr and "PTX ISA 8.5" in run.stderr
    assert ptx.read_text() == original  # the input is never modified


def test_release_and_isa_come_from_the_ptxas_itself(tmp_path: Path) -> None:
    script = _script()
    fake = _executable(tmp_path / "ptxas", (
        "#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\n"
        "echo 'Cuda compilation tools, release 12.6, V12.6.85'\n"))
    release = script.release_of(fake)
    assert release == (12, 6)
    assert script.ISA_OF_RELEASE[release] == "8.5"
    silent = _executable(tmp_path / "silent", "#!/bin/sh\necho nothing\n")
    with pytest.raises(SystemExit, match="names no release"):
        script.release_of(silent)
