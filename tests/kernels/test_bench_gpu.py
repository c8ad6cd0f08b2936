"""``python -m flashinfer_h3 bench`` on a GPU: every implementation measured with its accuracy,
progress lines, the JSON of several presets and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
