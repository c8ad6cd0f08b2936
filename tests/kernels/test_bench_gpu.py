"""``python -m flashinfer_h3 bench`` on a GPU: every implementation measured with its accuracy,
progress lines, the JSON of several presets and the plot, and the "kernel only" rows of the
kernel backends (absent for the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashinfer_h3 import backends, benchtools
from flashinfer_h3.__main__ import main

pytestmark = pytest.mark.gpu


def test_bench_small_on_the_gpu(tmp_path: Path, capsys) -> None:
    report = tmp_path / "bench.json"
    argv = ["bench", "--preset", "small", "--iters", "2", "--warmup", "1", "--json", str(report)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "bench.png")]
    except ImportError:
        pass
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "preset 'small'" in out and "segments [1,000, 537]" in out
    data = json.loads(report.read_text())
    (run,) = data["runs"]
    names = [r["name"] for r in run["results"]]
    assert any(n.startswith("flashinfer_h3 nvfp4") for n in names)
    assert "torch SDPA cuDNN bf16" in names and "torch SDPA flash bf16" in names
    for i, r in enumerate(run["results"], 1):
        assert f"[{i}/{len(names)}] small {r['name']}" in out  # one progress line each
        if r["name"].startswith("flashinfer_h3") or r["name"].startswith("torch SDPA"):
            assert r["ms"] > 0 and r["tflops"] > 0, r
        if r["ms"] is not None:
            name = r["name"]
            bar = (0.21 if "nvfp4" in name else 0.06 if "fp8" in name
                   else 0.02 if name.startswith("torch SDPA") else 0.25)  # SageAttention
            assert 0 <= r["rel_l2"] <= bar, r
    if "--plot" in argv:
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_two_presets_in_one_json(tmp_path: Path, capsys) -> None:
    report = tmp_path / "bench.json"
    assert main(["bench", "--preset", "small,h3-mix", "--op", "nvfp4", "--iters", "1",
                 "--warmup", "0", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert [r["preset"] for r in data["runs"]] == ["small", "h3-mix"]
    assert "preset" not in data  # several presets: only under runs


def test_bench_kernel_only_rows(tmp_path: Path, capsys) -> None:
    """Each operator on a kernel backend: a "kernel only" row right after its whole call, timed
    on the attention kernel alone, with the same output (bit for bit) and so the same error."""
    report = tmp_path / "bench.json"
    assert main(["bench", "--preset", "small", "--iters", "5", "--warmup", "1", "--json",
                 str(report)]) == 0
    out = capsys.readouterr().out
    results = json.loads(report.read_text())["results"]
    device = torch.device("cuda", torch.cuda.current_device())
    for op in ("nvfp4", "fp8"):
        prepared = backends.prepared(op, device)
        i, whole = next((i, r) for i, r in enumerate(results)
                        if r.get("op") == op and r.get("scope") == "whole call")
        if not prepared.backend.is_kernel:
            assert not any(r.get("op") == op and r.get("scope") == "kernel only"
                           for r in results)
            continue
        kernel = results[i + 1]
        assert kernel["name"] == benchtools.kernel_only_label(op, prepared.name)
        assert kernel["scope"] == "kernel only" and kernel["backend"] == prepared.name
        assert kernel["matches_whole_call"] is True, kernel
        assert kernel["rel_l2"] == whole["rel_l2"], (kernel, whole)
        assert 0 < kernel["ms"] <= whole["ms"] * 1.05, (kernel, whole)  # no pre-pass
        assert f"{op} [{prepared.name}]: the whole call takes" in out


def test_bench_no_kernel_only_row_for_the_reference(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLASHINFER_H3_FP8_BACKEND", "reference")
    report = tmp_path / "bench.json"
    assert main(["bench", "--preset", "small", "--op", "fp8", "--iters", "1", "--warmup", "0",
                 "--json", str(report)]) == 0
    results = json.loads(report.read_text())["results"]
    assert results[0]["name"] == "flashinfer_h3 fp8 [reference (torch emulation)]"
    assert results[0]["scope"] == "whole call" and results[0]["ms"] > 0
    assert not any("kernel only" in r["name"] or r.get("scope") == "kernel only"
                   for r in results)
