"""Packaging: one version, templates shipped as package data, and both a regular and an editable
install can find the templates (and JIT from them). Builds run on a copy of the repository so the
checkout is never touched."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flashinfer_h3
from flashinfer_h3 import version

REPO = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _source_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "src"
    dst.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o")
    for name in ("flashinfer_h3", "templates"):
        shutil.copytree(REPO / name, dst / name, ignore=ignore)
    return dst


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--no-deps", "--no-build-isolation", "-q"],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _shipped_template_files() -> set[str]:
    root = REPO / "templates"
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.suffix in (".jinja", ".cuh", ".h", ".cu")
    }


def test_version_has_one_source() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", version.__version__)
    assert flashinfer_h3.__version__ == version.__version__
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"]
    attr = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "flashinfer_h3.version.__version__"
    # The prebuilt-kernel wheel must carry the same version (the loader ignores a mismatch).
    init = (REPO / "jit_cache" / "flashinfer_h3_jit_cache" / "__init__.py").read_text()
    assert f'__version__ = "{version.__version__}"' in init


def test_dependencies_pin_tvm_ffi_to_one_minor_series() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in deps}
    # numpy: torch warns "Failed to initialize NumPy" on every import without it.
    assert {"torch", "numpy", "ninja", "jinja2", "filelock", "apache-tvm-ffi"} <= names
    (tvm,) = [d for d in deps if d.startswith("apache-tvm-ffi")]
    assert "<0.2" in tvm and ">=0.1." in tvm


def test_wheel_ships_every_template_and_header(tmp_path: Path) -> None:
    src = _source_copy(tmp_path)
    _pip("wheel", "-w", str(tmp_path / "dist"), str(src), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("flashinfer_h3-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        n.removeprefix("flashinfer_h3/templates/")
        for n in names
        if n.startswith("flashinfer_h3/templates/")
    }
    assert shipped == _shipped_template_files()
    for module in ("jit/__init__.py", "jit/build.py", "__main__.py", "version.py"):
        assert f"flashinfer_h3/{module}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert (
        "flashinfer-h3 = flashinfer_h3.__main__:main"
        in zipfile.ZipFile(wheel).read(entry_points).decode()
    )


def test_a_rebuilt_wheel_ships_no_stale_template(tmp_path: Path) -> None:
    # setuptools reuses ./build/lib of the checkout: a header removed since an earlier build
    # must not be shipped (it would also change every kernel's source key).
    src = _source_copy(tmp_path)
    stale = src / "templates" / "include" / "zz_removed_later.cuh"
    stale.write_text("// gone in the next build\n")
    _pip("wheel", "-w", str(tmp_path / "dist1"), str(src), cwd=src)
    stale.unlink()
    _pip("wheel", "-w", str(tmp_path / "dist2"), str(src), cwd=src)
    (first,) = (tmp_path / "dist1").glob("flashinfer_h3-*.whl")
    (second,) = (tmp_path / "dist2").glob("flashinfer_h3-*.whl")
    name = "flashinfer_h3/templates/include/zz_removed_later.cuh"
    assert name in zipfile.ZipFile(first).namelist()
    assert name not in zipfile.ZipFile(second).namelist()


_PROBE = """
import json, sys
import flashinfer_h3
from flashinfer_h3.jit import KernelConfig, make_spec, templates_dir
for op in ("utils", "nvfp4", "fp8"):
    make_spec(KernelConfig(op))
out = {"package": flashinfer_h3.__file__, "templates": str(templates_dir())}
if len(sys.argv) > 1:
    from flashinfer_h3.jit import build_module
    out["so"] = str(build_module(KernelConfig("utils", arch="sm_90a")))
print(json.dumps(out))
"""


def _probe(python: str, cwd: Path, env: dict[str, str], build: bool = False) -> dict:
    import json

    proc = subprocess.run(
        [python, "-c", _PROBE, *(["build"] if build else [])],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.nvcc
def test_regular_install_renders_and_jits_from_package_data(tmp_path: Path) -> None:
    src = _source_copy(tmp_path)
    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(src), cwd=tmp_path)
    shutil.rmtree(src)  # nothing may point back at the source tree
    env = {
        **os.environ,
        "PYTHONPATH": str(target),
        "FLASHINFER_H3_CACHE_DIR": str(tmp_path / "cache"),
    }
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    got = _probe(sys.executable, run_dir, env, build=True)
    assert Path(got["package"]).is_relative_to(target)
    assert Path(got["templates"]) == target / "flashinfer_h3" / "templates"
    so = Path(got["so"])
    assert so.is_file() and so.is_relative_to(tmp_path / "cache")
    ninja = (so.parent / "build.ninja").read_text()
    assert f"-I {target / 'flashinfer_h3' / 'templates' / 'include'}" in ninja


def _venv_seeing_this_environment(venv: Path) -> str:
    """A venv (no pip of its own) that sees exactly this interpreter's packages: pip, setuptools,
    torch, ... of the environment running the tests, which may itself be a venv.

    ``venv --system-site-packages`` would not do: it exposes the *base* interpreter's
    site-packages, which in a fresh venv lack this environment's packages and may hold an old
    setuptools (no ``bdist_wheel``). A ``.pth`` file named to sort after the editable install's
    own hooks adds this environment's site directories (and their ``.pth`` files) after the
    venv's own, so the venv's editable install wins."""
    import site
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    inner_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    if site.ENABLE_USER_SITE:
        outer.append(site.getusersitepackages())
    dirs = list(dict.fromkeys(d for d in outer if Path(d).is_dir()))
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
    (Path(inner_site) / "zzz_outer_environment.pth").write_text("\n".join(lines) + "\n")
    return str(python)


def test_editable_install_uses_the_checkout_templates(tmp_path: Path) -> None:
    src = _source_copy(tmp_path)
    venv = tmp_path / "venv"
    python = _venv_seeing_this_environment(venv)
    proc = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(src)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = _probe(python, run_dir, env)
    assert Path(got["package"]).resolve() == (src / "flashinfer_h3" / "__init__.py").resolve()
    assert Path(got["templates"]).resolve() == (src / "templates").resolve()
