"""``python -m flashinfer_h3 info | warmup | check | bench`` (CPU behaviour; GPU paths skip)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashinfer_h3.__main__ import PRESETS, attention_flops, main
from flashinfer_h3.version import __version__

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


def test_module_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flashinfer_h3", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"flashinfer_h3 {__version__}"


def test_info_reports_the_environment(capsys, session_cache_dir: Path) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"flashinfer_h3 {__version__}" in out
    assert "torch " in out and "apache-tvm-ffi " in out
    assert "nvcc:" in out and "templates:" in out
    assert f"cache: {session_cache_dir / __version__}" in out
    assert "prebuilt kernels:" in out
    assert ("GPU 0:" in out) if torch.cuda.is_available() else ("GPU: none" in out)


@pytest.mark.nvcc
def test_warmup_builds_the_named_archs_without_a_gpu(capsys, session_cache_dir: Path) -> None:
    assert main(["warmup", "--arch", "sm_90a,12.0", "--op", "utils"]) == 0
    captured = capsys.readouterr()
    assert "2 module(s)" in captured.out and "done" in captured.out
    assert "2/2" in captured.err  # the progress bar
    for arch in ("sm_90a", "sm_120a"):
        assert list((session_cache_dir / __version__ / arch).glob("utils_hd128_*/manifest.json"))
    # info now lists them
    main(["info"])
    assert "utils_hd128_sm120a_" in capsys.readouterr().out


def test_warmup_reports_build_failures(fake_nvcc, monkeypatch, capsys) -> None:
    fake_nvcc()
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    assert main(["warmup", "--arch", "sm_90a", "--op", "utils"]) == 1
    out = capsys.readouterr().out
    assert "utils for sm_90a failed" in out and "deliberate failure" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["warmup", "--arch", "sm_80"], "unsupported CUDA architecture 'sm_80'"),
        (["warmup", "--arch", "sm_90a", "--op", "bf16"], "unknown op(s) bf16"),
        (["bench", "--preset", "nope"], "unknown preset 'nope'"),
        (["check", "--op", "int8"], "unknown operator 'int8'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@no_gpu
def test_warmup_without_gpu_or_arch_says_what_to_pass(monkeypatch, capsys) -> None:
    monkeypatch.delenv("FLASHINFER_H3_CUDA_ARCH_LIST", raising=False)
    assert main(["warmup"]) == 2
    assert "--arch" in capsys.readouterr().err


@no_gpu
def test_check_without_gpu_checks_the_reference_against_the_oracle(capsys) -> None:
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "reference only" in out
    assert out.count("PASS") == 2 and "FAIL" not in out and "check: all passed" in out


@no_gpu
def test_bench_without_gpu_runs_the_reference_on_the_small_preset(capsys, tmp_path) -> None:
    report = tmp_path / "bench.json"
    assert main(["bench", "--op", "fp8", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "'small'" in out and "fp8 reference (CPU)" in out
    data = json.loads(report.read_text())
    assert data["preset"] == "small" and data["device"] == "cpu"
    assert data["flops"] == attention_flops(PRESETS["small"].lengths, PRESETS["small"].heads)
    (row,) = data["results"]
    assert row["ms"] > 0 and row["tflops"] > 0


def test_flops_follow_spec_6() -> None:
    assert attention_flops([61440], 56) == 4 * 61440**2 * 56 * 128
    assert attention_flops([3, 0, 5], 2) == 4 * (9 + 25) * 2 * 128
    assert PRESETS["h3-10s"].lengths == (61440,) and PRESETS["h3-10s"].heads == 56
    assert sum(PRESETS["h3-15s-sp4"].lengths) == 92160 and PRESETS["h3-15s-sp4"].heads == 14
