"""Cache keys: the URI hash covers sources, headers, flags, nvcc and tvm-ffi (no nvcc, no GPU)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer_h3.jit import KernelConfig, compute_uri, make_spec, templates_dir
from flashinfer_h3.jit.env import cache_root
from flashinfer_h3.version import __version__

NVCC = "Build cuda_13.0.r13.0/compiler.36424714_0"
TVM = "0.1.15.post2"


def _template_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "templates"
    shutil.copytree(templates_dir(), dst)
    return dst


def _uri(cfg: KernelConfig, tdir: Path | None = None, nvcc: str = NVCC) -> str:
    return make_spec(cfg, tdir).uri(nvcc)


def test_uri_format_and_cache_path() -> None:
    cfg = KernelConfig("utils", arch="sm_120a")
    spec = make_spec(cfg)
    uri = spec.uri(NVCC)
    assert re.fullmatch(r"utils_hd128_sm120a_[0-9a-f]{16}", uri), uri
    assert spec.so_path(NVCC) == cache_root() / __version__ / "sm_120a" / uri / f"{uri}.so"


def test_uri_is_deterministic_within_and_across_processes() -> None:
    cfg = KernelConfig("utils", arch="sm_90a")
    first, second = _uri(cfg), _uri(KernelConfig("utils", arch="sm_90a"))
    assert first == second
    code = (
        "from flashinfer_h3.jit import KernelConfig, make_spec; "
        f"print(make_spec(KernelConfig('utils', arch='sm_90a')).uri({NVCC!r}))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == first


def test_uri_changes_with_arch_and_flags() -> None:
    base = _uri(KernelConfig("utils", arch="sm_90a"))
    assert _uri(KernelConfig("utils", arch="sm_120a")) != base
    assert _uri(KernelConfig("utils", arch="sm_90a", flags={"x": 1})) != base
    assert _uri(KernelConfig("utils", arch="sm_90a", flags={"x": 2})) != _uri(
        KernelConfig("utils", arch="sm_90a", flags={"x": 1})
    )


def test_uri_changes_with_extra_nvcc_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = KernelConfig("utils")
    monkeypatch.delenv("FLASHINFER_H3_NVCC_FLAGS", raising=False)
    base = make_spec(cfg)
    monkeypatch.setenv("FLASHINFER_H3_NVCC_FLAGS", "-DFOO=1 --maxrregcount 128")
    extra = make_spec(cfg)
    assert extra.uri(NVCC) != base.uri(NVCC)
    assert extra.cuda_flags[-3:] == ("-DFOO=1", "--maxrregcount", "128")


def test_uri_changes_with_toolchain_versions() -> None:
    spec = make_spec(KernelConfig("utils"))
    base = spec.uri(NVCC)
    assert spec.uri("Build cuda_13.1.r13.1/compiler.1_0") != base
    cfg, key = spec.config, spec.source_key
    assert compute_uri(cfg, key, NVCC, spec.tvm_ffi_version) == base
    assert compute_uri(cfg, key, NVCC, "0.1.16") != base


def test_uri_changes_with_the_rendered_source(tmp_path: Path) -> None:
    tdir = _template_copy(tmp_path)
    cfg = KernelConfig("utils")
    base = _uri(cfg, tdir)
    assert base == _uri(cfg)  # a byte-identical copy gives the same key
    path = tdir / "utils.cu.jinja"
    path.write_text(path.read_text() + "\n// one more line\n")
    assert _uri(cfg, tdir) != base


def test_uri_changes_with_any_header(tmp_path: Path) -> None:
    tdir = _template_copy(tmp_path)
    cfg = KernelConfig("utils")
    base = _uri(cfg, tdir)
    # A header the module does not even include still counts: the hash is over all of them.
    header = tdir / "include" / "numerics" / "formats.cuh"
    header.write_text(header.read_text() + "\n")
    edited = _uri(cfg, tdir)
    assert edited != base
    (tdir / "include" / "new_header.cuh").write_text("#pragma once\n")
    assert _uri(cfg, tdir) not in (base, edited)


def test_source_key_ignores_the_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    # The prebuilt lookup matches on source_key, which must not depend on the local nvcc.
    monkeypatch.setenv("FLASHINFER_H3_NVCC", "/nonexistent/nvcc")
    key = make_spec(KernelConfig("utils")).source_key
    monkeypatch.delenv("FLASHINFER_H3_NVCC")
    assert make_spec(KernelConfig("utils")).source_key == key
    assert re.fullmatch(r"[0-9a-f]{64}", key)


def test_spec_flags_are_the_documented_ones() -> None:
    flags = make_spec(KernelConfig("utils", arch="sm_120a")).cuda_flags
    for required in (
        "-O3",
        "-std=c++17",
        "-fPIC",
        "--expt-relaxed-constexpr",
        "-gencode=arch=compute_120a,code=sm_120a",
        "-lineinfo",
    ):
        assert required in flags
    assert flags[flags.index("-Xptxas") + 1] == "-v"
    assert not any("fast_math" in f or "fast-math" in f for f in flags)
    json.dumps(list(flags))  # recorded in the manifest


def test_register_usage_level_of_the_hopper_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    # jit/modules.py: the Hopper modules build at the ptxas register usage level measured fastest,
    # a KernelConfig flag overrides it, and modules without one get ptxas's default (no option).
    monkeypatch.delenv("FLASHINFER_H3_NVCC_FLAGS", raising=False)
    for module in ("fp8_wgmma", "nvfp4_wgmma"):
        production = make_spec(KernelConfig(module, arch="sm_90a"))
        assert "--register-usage-level=8" in production.cuda_flags
        at = production.cuda_flags.index("--register-usage-level=8")
        assert production.cuda_flags[at - 1] == "-Xptxas"
        old = make_spec(KernelConfig(module, arch="sm_90a", flags={"register_usage_level": 5}))
        assert "--register-usage-level=5" in old.cuda_flags
        assert "--register-usage-level=8" not in old.cuda_flags
        assert old.uri(NVCC) != production.uri(NVCC)
    for module in ("utils", "fp8", "nvfp4"):
        flags = make_spec(KernelConfig(module, arch="sm_90a")).cuda_flags
        assert not any(f.startswith("--register-usage-level") for f in flags)
    # The environment's extra flags still come last (they may override the module's).
    monkeypatch.setenv("FLASHINFER_H3_NVCC_FLAGS", "-Xptxas --register-usage-level=3")
    flags = make_spec(KernelConfig("fp8_wgmma", arch="sm_90a")).cuda_flags
    assert flags[-2:] == ("-Xptxas", "--register-usage-level=3")


@pytest.mark.parametrize("level", [-1, 11, True, "8"])
def test_register_usage_level_flag_is_checked(level: object) -> None:
    with pytest.raises(ValueError, match="register_usage_level"):
        make_spec(KernelConfig("fp8_wgmma", arch="sm_90a", flags={"register_usage_level": level}))


def test_register_usage_level_of_a_module_is_checked() -> None:
    from flashinfer_h3.jit.modules import ModuleDef, register_module

    with pytest.raises(ValueError, match="register_usage_level"):
        register_module(ModuleDef("bad_level_for_test", ("utils.cu.jinja",), None,
                                  register_usage_level=12))


@pytest.mark.parametrize("op,output", [("nvfp4", "bytes"), ("fp8", "fp16"), (None, "fp16")])
def test_prepass_output_of_a_module_is_checked(op: str | None, output: str) -> None:
    # jit/modules.py: a pre-pass writes codes, or (NVFP4 only) the FP16 operands of the Hopper
    # kernel; quantize.cu.jinja renders the export that goes with it.
    from flashinfer_h3.jit.modules import MODULES, ModuleDef, register_module

    with pytest.raises(ValueError, match="prepass_output"):
        register_module(ModuleDef("bad_prepass_for_test", ("quantize.cu.jinja",), op,
                                  prepass_output=output))
    assert "bad_prepass_for_test" not in MODULES
    assert {m.name for m in MODULES.values() if m.prepass_output == "fp16"} == {"nvfp4_wgmma"}
