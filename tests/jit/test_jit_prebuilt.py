"""Prebuilt-kernel lookup (the flashinfer_h3_jit_cache wheel or FLASHINFER_H3_PREBUILT_DIR)
comes before any JIT, and only exactly matching, intact kernels are used."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from flashinfer_h3.jit import (
    KernelConfig,
    MissingToolchainError,
    build_module,
    export_prebuilt,
    list_prebuilt,
    prebuilt_dirs,
)
from flashinfer_h3.jit import prebuilt as jit_prebuilt

REPO = Path(__file__).resolve().parents[2]
CFG = KernelConfig("utils", arch="sm_90a")


@pytest.fixture
def prebuilt(fake_nvcc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A prebuilt dir made by export_prebuilt with the fake nvcc; then the JIT is made
    impossible (no nvcc) so that any fall-through to it shows up as an error."""
    fake = fake_nvcc()
    out = tmp_path / "prebuilt"
    manifest = export_prebuilt([CFG, KernelConfig("utils", arch="sm_120a")], out)
    assert len(fake.calls("link")) == 2
    monkeypatch.setenv("FLASHINFER_H3_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("FLASHINFER_H3_NVCC", "/nonexistent/nvcc")
    monkeypatch.setattr(jit_prebuilt, "_warned", set())
    return out, manifest


def test_prebuilt_dir_is_used_before_jit(prebuilt, monkeypatch: pytest.MonkeyPatch) -> None:
    out, manifest = prebuilt
    monkeypatch.setenv("FLASHINFER_H3_PREBUILT_DIR", str(out))
    monkeypatch.setenv("FLASHINFER_H3_DISABLE_JIT", "1")
    so = build_module(CFG)
    assert so.parent == out / "sm_90a"
    assert build_module(KernelConfig("utils", arch="sm_120a")).parent == out / "sm_120a"
    entries = json.loads(manifest.read_text())["kernels"]
    assert {e["arch"] for e in entries} == {"sm_90a", "sm_120a"}
    assert [p for p, _ in list_prebuilt()] == [out / e["file"] for e in entries]
    # use_prebuilt=False skips it (and there is no nvcc here).
    monkeypatch.delenv("FLASHINFER_H3_DISABLE_JIT")
    with pytest.raises(MissingToolchainError):
        build_module(CFG, use_prebuilt=False)


def test_the_jit_cache_package_is_found(prebuilt, tmp_path: Path, monkeypatch) -> None:
    out, _ = prebuilt
    site = tmp_path / "site"
    pkg = site / "flashinfer_h3_jit_cache"
    # Only the package's code: kernels/ built in the checkout (build_kernels.py) stays out.
    shutil.copytree(
        REPO / "jit_cache" / "flashinfer_h3_jit_cache",
        pkg,
        ignore=shutil.ignore_patterns("kernels", "__pycache__"),
    )
    shutil.copytree(out, pkg / "kernels")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "flashinfer_h3_jit_cache", raising=False)
    importlib.invalidate_caches()
    try:
        assert prebuilt_dirs() == [pkg.resolve() / "kernels"]
        so = build_module(CFG)
        assert so == pkg.resolve() / "kernels" / "sm_90a" / so.name
    finally:
        sys.modules.pop("flashinfer_h3_jit_cache", None)


def _edit_manifest(out: Path, **changes) -> None:
    path = out / "manifest.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "flashinfer_h3":
            data[key] = value
        else:
            for entry in data["kernels"]:
                entry[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("change", "warning"),
    [
        ({"flashinfer_h3": "0.0.1"}, "built for flashinfer_h3 0.0.1"),
        ({"source_key": "0" * 64}, None),  # other sources: silently not a match
        ({"tvm_ffi": "0.2.0"}, "apache-tvm-ffi 0.2.0"),
        ({"sha256": "0" * 64}, "SHA-256 does not match"),
    ],
)
def test_mismatched_prebuilt_falls_through_to_jit(
    prebuilt, monkeypatch, capfd: pytest.CaptureFixture[str], change: dict, warning: str | None
) -> None:
    out, _ = prebuilt
    _edit_manifest(out, **change)
    monkeypatch.setenv("FLASHINFER_H3_PREBUILT_DIR", str(out))
    with pytest.raises(MissingToolchainError):  # fell through to the JIT, which has no nvcc
        build_module(CFG)
    err = capfd.readouterr().err
    if warning is not None:
        assert warning in err


def test_corrupt_prebuilt_so_is_not_loaded(prebuilt, monkeypatch) -> None:
    out, _ = prebuilt
    so = next((out / "sm_90a").glob("*.so"))
    so.write_bytes(so.read_bytes()[:10])
    monkeypatch.setenv("FLASHINFER_H3_PREBUILT_DIR", str(out))
    with pytest.raises(MissingToolchainError):
        build_module(CFG)


def test_template_change_invalidates_prebuilt(prebuilt, tmp_path: Path, monkeypatch) -> None:
    out, _ = prebuilt
    monkeypatch.setenv("FLASHINFER_H3_PREBUILT_DIR", str(out))
    tdir = tmp_path / "templates"
    shutil.copytree(REPO / "templates", tdir)
    (tdir / "utils.cu.jinja").write_text((tdir / "utils.cu.jinja").read_text() + "// edit\n")
    with pytest.raises(MissingToolchainError):
        build_module(CFG, template_dir=tdir)
    assert build_module(CFG).is_relative_to(out)  # the untouched sources still match


@pytest.mark.nvcc
def test_real_prebuilt_module_loads(tmp_path: Path, monkeypatch) -> None:
    import torch

    from flashinfer_h3.jit import clear_module_cache, get_module

    if torch.cuda.is_available():
        pytest.skip("loads an sm_120a module through the no-GPU arch override")
    out = tmp_path / "prebuilt"
    export_prebuilt([KernelConfig("utils", arch="sm_120a")], out)  # session cache: no rebuild
    monkeypatch.setenv("FLASHINFER_H3_PREBUILT_DIR", str(out))
    monkeypatch.setenv("FLASHINFER_H3_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("FLASHINFER_H3_DISABLE_JIT", "1")
    monkeypatch.setenv("FLASHINFER_H3_CUDA_ARCH_LIST", "sm_120a")
    clear_module_cache()
    try:
        assert "arch=sm_120a" in get_module("utils").build_info()
    finally:
        clear_module_cache()
