"""Arch detection, the arch-list override, cache dirs and toolchain discovery (no GPU: the GPU
queries of torch are replaced by fakes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashinfer_h3.jit import UnsupportedArchError, cache_dir, detect_arch, parse_arch_list
from flashinfer_h3.jit import env as jit_env
from flashinfer_h3.version import __version__


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """``gpu((major, minor))`` makes torch report one GPU of that capability; ``gpu(None)``
    makes it report none."""
    monkeypatch.delenv("FLASHINFER_H3_CUDA_ARCH_LIST", raising=False)

    def set_gpu(capability: tuple[int, int] | None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: int(capability is not None))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU")

    return set_gpu


@pytest.mark.parametrize(
    ("capability", "arch"), [((9, 0), "sm_90a"), ((12, 0), "sm_120a"), ((12, 1), "sm_121a")]
)
def test_supported_gpus_map_to_their_arch(gpu, capability, arch) -> None:
    gpu(capability)
    assert detect_arch() == arch
    assert detect_arch(torch.device("cuda", 0)) == arch
    assert detect_arch(0) == arch


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 1), (10, 0), (11, 0), (12, 3)])
def test_other_gpus_get_spec_2_runtime_error(gpu, capability) -> None:
    gpu(capability)
    with pytest.raises(RuntimeError) as info:
        detect_arch()
    msg = str(info.value)
    assert f"compute capability {capability[0]}.{capability[1]}" in msg
    for supported in ("9.0 (sm_90a", "12.0 (sm_120a", "12.1 (sm_121a"):
        assert supported in msg
    assert isinstance(info.value, UnsupportedArchError)


def test_no_gpu_needs_the_override(gpu, monkeypatch) -> None:
    gpu(None)
    with pytest.raises(RuntimeError, match="FLASHINFER_H3_CUDA_ARCH_LIST"):
        detect_arch()
    monkeypatch.setenv("FLASHINFER_H3_CUDA_ARCH_LIST", "12.0, 9.0")
    assert detect_arch() == "sm_120a"  # without a GPU: the first entry


def test_override_picks_the_entry_of_the_gpu(gpu, monkeypatch) -> None:
    gpu((9, 0))
    monkeypatch.setenv("FLASHINFER_H3_CUDA_ARCH_LIST", "sm_120a;sm_90a")
    assert detect_arch() == "sm_90a"
    monkeypatch.setenv("FLASHINFER_H3_CUDA_ARCH_LIST", "sm_120a")
    with pytest.raises(RuntimeError, match=r"no entry for GPU 0 \(compute capability 9\.0"):
        detect_arch()


def test_bad_override_names_the_variable(gpu, monkeypatch) -> None:
    gpu(None)
    monkeypatch.setenv("FLASHINFER_H3_CUDA_ARCH_LIST", "sm_90a sm_75")
    with pytest.raises(UnsupportedArchError, match="FLASHINFER_H3_CUDA_ARCH_LIST=.*'sm_75'"):
        detect_arch()


def test_non_cuda_device_is_a_value_error(gpu) -> None:
    gpu((9, 0))
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        detect_arch(torch.device("cpu"))


def test_parse_arch_list_dedups_and_keeps_order() -> None:
    assert parse_arch_list(" 9.0,sm_90a  12.0;120a ") == ["sm_90a", "sm_120a"]
    assert parse_arch_list("") == []


def test_cache_dir_layout(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLASHINFER_H3_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir("sm_90a") == tmp_path / "c" / __version__ / "sm_90a"
    monkeypatch.delenv("FLASHINFER_H3_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("sm_120a") == tmp_path / "home/.cache/flashinfer_h3" / __version__ / "sm_120a"
    monkeypatch.setenv("FLASHINFER_H3_CACHE_DIR", "~/elsewhere")
    assert jit_env.cache_root() == tmp_path / "home" / "elsewhere"


def test_nvcc_discovery_order(monkeypatch, tmp_path: Path) -> None:
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.delenv("FLASHINFER_H3_NVCC", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert jit_env.find_nvcc() == nvcc
    monkeypatch.setenv("FLASHINFER_H3_NVCC", str(tmp_path / "missing"))
    assert jit_env.find_nvcc() is None  # an explicit choice is never silently replaced


@pytest.mark.parametrize(
    ("value", "disabled"), [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)]
)
def test_disable_jit_values(monkeypatch, value: str, disabled: bool) -> None:
    monkeypatch.setenv("FLASHINFER_H3_DISABLE_JIT", value)
    assert jit_env.jit_disabled() is disabled
