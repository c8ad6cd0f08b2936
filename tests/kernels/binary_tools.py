"""Reading a built kernel module back from its binary, for the nvcc build/SASS tests (no GPU),
and building header-only device code as a host library for exhaustive CPU checks.

Every reader takes the module's ``.so`` and the kernel's (mangled-name substring) ``kernel``;
cuobjdump comes from the CUDA toolkit or the pip ``nvidia-cuda-cuobjdump`` of the ``[test]``
extra (``tests/conftest.py`` puts it on PATH); without it the calling test skips.
"""

from __future__ import annotations

import ctypes
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


def assert_no_local_memory(so: Path, kernel: str) -> None:
    """No local memory at all: ptxas reports no stack frame and no spills, the resource usage
    has STACK and LOCAL 0, and the SASS has no LDL / STL."""
    report = ptxas_report(so, kernel)
    print(report)
    no_local = r"\b0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    assert re.search(no_local, report), report
    res = resources(so, kernel)
    print(f"{kernel}: {res}")
    assert res["STACK"] == 0 and res["LOCAL"] == 0, res
    local = [line.strip() for line in sass(so, kernel).splitlines()
             if re.search(r"\b(?:LDL|STL)\b", line)]
    assert not local, "local-memory accesses in the SASS:\n" + "\n".join(local[:20])


def build_host_library(out: Path, stem: str, source: str, *, pthread: bool = False) -> ctypes.CDLL:
    """``source`` (C++ that includes headers of templates/include) built by nvcc as a host
    shared library and loaded. ``-x c++``: a host build with the CUDA headers (no __CUDACC__, so
    no kernel launches); ``-ffp-contract=off`` keeps every a * b + c two roundings, as the
    ``__f*_rn`` intrinsics are. Skips the calling test without nvcc."""
    from flashinfer_h3.jit import find_nvcc
    from flashinfer_h3.jit.env import include_dir

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc (none on PATH or CUDA_HOME)")
    src, lib = out / f"{stem}.cpp", out / f"lib{stem}.so"
    src.write_text(source)
    host_flags = "-fPIC,-pthread,-ffp-contract=off" if pthread else "-fPIC,-ffp-contract=off"
    cmd = [str(nvcc), "-x", "c++", "-std=c++17", "-O2", "-shared", "-Xcompiler", host_flags,
           f"-I{include_dir()}", str(src), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    return ctypes.CDLL(str(lib))


def sass_tile_loop():
    """benchmarks/sass_tile_loop.py, imported by path (benchmarks/ is not a package)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_tile_loop.py"
    spec = importlib.util.spec_from_file_location("sass_tile_loop", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module
