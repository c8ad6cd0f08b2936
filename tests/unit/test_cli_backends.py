"""``python -m flashinfer_h3 info`` names the backend of each operator (a kernel or the torch
emulation); ``check`` labels a reference fallback as such."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flashinfer_h3 import backends
from flashinfer_h3.__main__ import main


def _fp8_has_kernel(arch: str) -> bool:
    return backends.resolve_for_arch("fp8", arch).is_kernel


@pytest.fixture(autouse=True)
def _auto(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in backends.ENV_BACKEND.values():
        monkeypatch.delenv(env, raising=False)


@pytest.mark.parametrize("arch,nvfp4,module", [("sm_90a", "wgmma_fp16_nvfp4", "nvfp4_wgmma"),
                                               ("sm_120a", "mma_sync_fp4", "nvfp4")])
def test_info_arch_prints_the_backend_of_each_operator(arch: str, nvfp4: str, module: str,
                                                       capsys) -> None:
    assert main(["info", "--arch", arch]) == 0
    out = capsys.readouterr().out
    assert f"backends on {arch}" in out
    assert f"nvfp4: {nvfp4} (kernel) [auto; module {module}]" in out
    if not _fp8_has_kernel(arch):
        assert "fp8  : reference (torch emulation) [auto; no kernel module]" in out


def test_info_shows_the_users_choice_and_its_errors(monkeypatch, capsys) -> None:
    monkeypatch.setenv("FLASHINFER_H3_NVFP4_BACKEND", "reference")
    assert main(["info", "--arch", "sm_90a"]) == 0
    assert ("nvfp4: reference (torch emulation) [FLASHINFER_H3_NVFP4_BACKEND=reference"
            in capsys.readouterr().out)
    monkeypatch.setenv("FLASHINFER_H3_NVFP4_BACKEND", "sm120")
    assert main(["info", "--arch", "sm_90a"]) == 0
    out = capsys.readouterr().out
    assert "nvfp4: none: FLASHINFER_H3_NVFP4_BACKEND=sm120 (now named mma_sync_fp4) needs" in out


def test_info_arch_runs_without_torch_cuda_in_a_subprocess() -> None:
    out = subprocess.run([sys.executable, "-m", "flashinfer_h3", "info", "--arch", "sm_120a"],
                         capture_output=True, text=True, check=True).stdout
    assert "nvfp4: mma_sync_fp4 (kernel)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_info_without_gpu_or_arch_says_what_to_pass(monkeypatch, capsys) -> None:
    monkeypatch.delenv("FLASHINFER_H3_CUDA_ARCH_LIST", raising=False)
    assert main(["info"]) == 0
    assert "pass --arch sm_90a or --arch sm_120a" in capsys.readouterr().out


def test_info_bad_arch_is_a_usage_error(capsys) -> None:
    assert main(["info", "--arch", "sm_80"]) == 2
    assert "sm_80" in capsys.readouterr().err


@pytest.mark.gpu
def test_check_labels_the_backend(capsys) -> None:
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    device = torch.device("cuda", torch.cuda.current_device())
    for op in backends.OPERATORS:
        label = backends.prepared(op, device).backend.label
        assert f"{op:5s} {label}" in out
        if not backends.prepared(op, device).backend.is_kernel:
            assert "no kernel on this GPU" in out and "vs reference" not in out.split(op)[1][:80]
