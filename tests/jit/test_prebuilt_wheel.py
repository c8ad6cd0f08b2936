"""The flashinfer-h3-jit-cache wheel (jit_cache/): platform tag, version pin, never empty, every
production module of the JIT registry. Runs on a copy of jit_cache/ with the fake nvcc."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from flashinfer_h3.version import __version__

REPO = Path(__file__).resolve().parents[2]


def _load_build_kernels():
    spec = importlib.util.spec_from_file_location(
        "_build_kernels_under_test", REPO / "jit_cache" / "build_kernels.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A copy of the jit_cache project without any built kernels."""
    dst = tmp_path / "jit_cache"
    shutil.copytree(
        REPO / "jit_cache",
        dst,
        ignore=shutil.ignore_patterns("kernels", "kernels.partial", "build", "*.egg-info",
                                      "__pycache__"),
    )
    return dst


def _wheel(project: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(project)],
        capture_output=True,
        text=True,
    )


def test_an_empty_wheel_is_refused(project: Path, tmp_path: Path) -> None:
    proc = _wheel(project, tmp_path / "dist")
    assert proc.returncode != 0
    assert "refusing to build an empty wheel" in proc.stdout + proc.stderr
    assert "build_kernels.py" in proc.stdout + proc.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


def test_build_kernels_ships_every_production_module(fake_nvcc, project: Path,
                                                     tmp_path: Path) -> None:
    fake = fake_nvcc()
    build_kernels = _load_build_kernels()
    kernels = project / "flashinfer_h3_jit_cache" / "kernels"
    (kernels / "sm_90a").mkdir(parents=True)
    (kernels / "sm_90a" / "stale.so").write_bytes(b"old")
    assert build_kernels.main(["--arch", "sm_90a,sm_120a", "--out", str(kernels)]) == 0
    entries = json.loads((kernels / "manifest.json").read_text())["kernels"]
    expected = [
        (name, arch)
        for arch in ("sm_90a", "sm_120a")
        for name, archs in build_kernels.production_modules()
        if archs is None or arch in archs
    ]
    key = "module" if "module" in entries[0] else "op"
    assert [(e[key], e["arch"]) for e in entries] == expected
    assert {"utils", "nvfp4", "fp8"} <= {name for name, _ in expected}
    assert not any("probe" in name for name, _ in expected)  # test-only modules stay out
    assert len(fake.calls("link")) == len(expected)
    assert not (kernels / "sm_90a" / "stale.so").exists()  # kernels/ is replaced as a whole

    proc = _wheel(project, tmp_path / "dist")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name == f"flashinfer_h3_jit_cache-{__version__}-py3-none-{platform}.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(f"flashinfer_h3_jit_cache-{__version__}.dist-info/METADATA").decode()
        wheel_info = zf.read(f"flashinfer_h3_jit_cache-{__version__}.dist-info/WHEEL").decode()
    assert f"Requires-Dist: flashinfer-h3=={__version__}" in metadata
    assert "Root-Is-Purelib: false" in wheel_info
    assert "flashinfer_h3_jit_cache/kernels/manifest.json" in names
    assert {f"flashinfer_h3_jit_cache/kernels/{e['file']}" for e in entries} <= names
    assert not any(n.endswith("stale.so") for n in names)

    # A kernel that is not in the manifest (or was altered) stops the build.
    (kernels / "sm_120a" / "extra.so").write_bytes(b"\x7fELF")
    proc = _wheel(project, tmp_path / "dist2")
    assert proc.returncode != 0 and "stale" in proc.stdout + proc.stderr


def test_build_kernels_rejects_an_unknown_module() -> None:
    path_before = list(sys.path)
    build_kernels = _load_build_kernels()
    # Loading the script leaves the process alone: the checkout's (possibly built) kernels must
    # not become the installed prebuilt package of the rest of the test session.
    assert sys.path == path_before and "flashinfer_h3_jit_cache" not in sys.modules
    with pytest.raises(SystemExit, match="unknown module"):
        build_kernels.module_configs(["sm_90a"], ["nope"])
