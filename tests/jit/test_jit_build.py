"""Real nvcc builds through the JIT path (no GPU needed): every module for sm_90a and sm_120a,
loading through tvm-ffi on the CPU, corrupt-.so recovery and nvcc failures.

Modules are built into the session cache (conftest), so other tests reuse them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flashinfer_h3 import jit
from flashinfer_h3.jit import (
    JitBuildError,
    KernelConfig,
    build_module,
    clear_module_cache,
    get_module,
    load_so,
    read_manifest,
    templates_dir,
    valid_so,
)

pytestmark = pytest.mark.nvcc

ARCHS = ("sm_90a", "sm_120a")


def _cuobjdump() -> str | None:
    return shutil.which("cuobjdump")


@pytest.mark.parametrize("arch", ARCHS)
def test_utils_module_builds_and_reports_resources(arch: str) -> None:
    so = build_module(KernelConfig("utils", arch=arch))
    assert so.is_file() and valid_so(so, read_manifest(so.parent))
    log = (so.parent / "build.log").read_text()
    # -Xptxas -v output is kept: other tests read register counts from it.
    assert re.search(r"ptxas info\s*: Used \d+ registers", log), log[-2000:]
    assert f"code={arch}" in (so.parent / "build.ninja").read_text()
    if _cuobjdump():
        elf = subprocess.run(
            [_cuobjdump(), "--list-elf", str(so)], capture_output=True, text=True, check=True
        ).stdout
        assert arch in elf, elf


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", ["nvfp4", "fp8"])
def test_every_operator_module_builds(op: str, arch: str) -> None:
    so = build_module(KernelConfig(op, arch=arch))
    assert valid_so(so, read_manifest(so.parent))
    manifest = read_manifest(so.parent)
    assert manifest is not None and manifest["config"]["arch"] == arch
    log = (so.parent / "build.log").read_text()
    assert "ptxas info" in log and " error" not in log.lower()


@pytest.mark.parametrize("arch", ARCHS)
def test_module_loads_on_cpu_and_cpp_checks_raise(arch: str) -> None:
    # Loading needs no GPU (the CUDA runtime initialises lazily); a C++ argument check turns
    # into a Python ValueError carrying its message.
    mod = load_so(build_module(KernelConfig("utils", arch=arch)))
    info = mod.build_info()
    assert f"arch={arch}" in info and "module=utils" in info
    with pytest.raises(ValueError, match="fill_u8: t must be a CUDA tensor"):
        mod.fill_u8(torch.zeros(8, dtype=torch.uint8), 1)
    with pytest.raises(TypeError):
        mod.fill_u8(torch.zeros(8, dtype=torch.uint8))  # wrong argument count
    assert mod.build_info() == info  # still usable after errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of get_module")
def test_get_module_without_gpu_uses_the_arch_override(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_module_cache()
    monkeypatch.delenv("FLASHINFER_H3_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(RuntimeError, match="FLASHINFER_H3_CUDA_ARCH_LIST"):
        get_module("utils")
    monkeypatch.setenv("FLASHINFER_H3_CUDA_ARCH_LIST", "12.0 9.0")
    mod = get_module("utils")
    assert "arch=sm_120a" in mod.build_info()
    assert get_module("utils") is mod  # cached per process
    clear_module_cache()


def test_corrupt_so_is_rebuilt_with_real_nvcc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = KernelConfig("utils", arch="sm_90a")
    built = build_module(cfg)  # in the session cache
    # Work on a private copy of the cache so the shared .so stays intact.
    version_dir = built.parent.parent.parent
    private = tmp_path / "cache"
    shutil.copytree(version_dir, private / version_dir.name)
    monkeypatch.setenv("FLASHINFER_H3_CACHE_DIR", str(private))
    so = build_module(cfg)
    assert so != built and so.name == built.name
    capfd.readouterr()
    so.write_bytes(so.read_bytes()[:4096])  # a truncated (partial) .so
    rebuilt = build_module(cfg)
    assert rebuilt == so and valid_so(rebuilt, read_manifest(rebuilt.parent))
    assert "compiling utils kernels for sm_90a" in capfd.readouterr().err
    mod = load_so(rebuilt)
    assert "arch=sm_90a" in mod.build_info()


def test_nvcc_error_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    tdir = tmp_path / "templates"
    shutil.copytree(templates_dir(), tdir)
    (tdir / "utils.cu.jinja").write_text(
        '// {{ arch }}\nstatic_assert(sizeof(int) == 3, "deliberate_failure_marker");\n'
    )
    with pytest.raises(JitBuildError) as info:
        build_module(KernelConfig("utils", arch="sm_90a"), template_dir=tdir)
    msg = str(info.value)
    assert "deliberate_failure_marker" in msg and "build.log" in msg
    assert "utils_hd128_sm90a_" in msg


def test_jit_package_exports_the_documented_api() -> None:
    for name in ("KernelConfig", "get_module", "build_module", "detect_arch"):
        assert callable(getattr(jit, name))
