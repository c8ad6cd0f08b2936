"""Reading a built kernel module back from its binary, for the nvcc build/SASS tests (no GPU).

Every function takes the module's ``.so`` and the kernel's (mangled-name substring) ``kernel``;
cuobjdump comes from the CUDA toolkit or the pip ``nvidia-cuda-cuobjdump`` of the ``[test]``
extra (``tests/conftest.py`` puts it on PATH); without it the calling test skips.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest


def cuobjdump(*args: str) -> str:
    exe = shutil.which("cuobjdump")
    if exe is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or pip nvidia-cuda-cuobjdump)")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=True).stdout


def resources(so: Path, kernel: str) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of the kernel: REG, STACK, SHARED, LOCAL, ..."""
    text = cuobjdump("--dump-resource-usage", str(so))
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "Function" in line and kernel in line:
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", lines[i + 1]))
            return {key: int(value) for key, value in fields.items()}
    raise AssertionError(f"{kernel} not in the resource usage of {so}:\n{text[:2000]}")


def sass(so: Path, kernel: str) -> str:
    """The kernel's SASS (exactly one function must match)."""
    blocks = re.split(r"\n\s*Function : ", cuobjdump("--dump-sass", str(so)))
    mine = [b for b in blocks if kernel in b.split("\n", 1)[0]]
    assert len(mine) == 1, f"expected one SASS function named *{kernel}*, found {len(mine)}"
    return mine[0]


def max_threads(so: Path, kernel: str) -> tuple[int, ...]:
    """The kernel's ``__launch_bounds__`` threads (EIATTR_MAX_THREADS of its .nv.info)."""
    text = cuobjdump("-elf", str(so))
    # The section itself (a line of its own), not its entry in the section header table.
    section = re.search(r"^\.nv\.info\.\S*" + kernel + r"\S*[ \t]*\n(.*?)(?:^\.|\Z)", text,
                        re.S | re.M)
    assert section, f"no .nv.info section of {kernel}"
    m = re.search(r"EIATTR_MAX_THREADS\s*\n\s*Format:\s*\S+\s*\n\s*Value:\s*([0-9a-fx ]+)",
                  section.group(1))
    assert m, f"{kernel} has no EIATTR_MAX_THREADS (no __launch_bounds__?)"
    return tuple(int(x, 16) for x in m.group(1).split())


def ptxas_report(so: Path, kernel: str) -> str:
    """ptxas' report of the kernel (stack, spills, registers) from the module's build log."""
    log = so.parent / "build.log"
    m = re.search(r"Compiling entry function '\S*" + kernel + r"\S*'.*?\n(.*?Used \d+ registers)",
                  log.read_text(), re.S)
    assert m, f"no ptxas report of {kernel} in {log}"
    return m.group(1)


def load(so: Path) -> Any:
    import tvm_ffi

    return tvm_ffi.load_module(str(so))
