"""``python -m flashinfer_h3 bench`` on the CPU: plain help, option checks, no silent huge CPU
run, the sampled oracle of the accuracy column, the JSON layout and the plot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashinfer_h3 import benchtools
from flashinfer_h3.__main__ import PRESETS, build_parser, main

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


def _help(*argv: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "flashinfer_h3", *argv, "--help"],
        capture_output=True, text=True, check=True,
    ).stdout


@pytest.mark.parametrize("argv", [(), ("info",), ("warmup",), ("check",), ("bench",)])
def test_help_is_plain_text(argv: tuple[str, ...]) -> None:
    text = _help(*argv)
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert text.startswith("usage: python -m flashinfer_h3")


def test_every_option_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
    bench = _help("bench")
    for option in ("--iters", "--warmup", "--seed", "--json", "--plot", "--preset"):
        assert option in bench
    for preset in PRESETS:
        assert preset in bench


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--iters", "0"], "--iters: must be >= 1, got 0"),
        (["bench", "--iters", "-3"], "--iters: must be >= 1"),
        (["bench", "--warmup", "-1"], "--warmup: must be >= 0"),
    ],
)
def test_bench_rejects_bad_counts(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@no_gpu
@pytest.mark.parametrize("preset", ["h3-mix", "h3-10s", "small,h3-15s-sp4", "all"])
def test_bench_refuses_gpu_presets_without_a_gpu(preset: str, capsys) -> None:
    assert main(["bench", "--preset", preset]) == 2
    captured = capsys.readouterr()
    assert "no CUDA GPU visible" in captured.out and "On a GPU this command times" in captured.out
    assert "needs a CUDA GPU" in captured.err and "only --preset small runs" in captured.err
    assert "tokens x" in captured.err  # the shape that would have run
    assert "reference (CPU)" not in captured.out  # nothing started


def test_bench_plot_without_matplotlib_fails_before_measuring(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "flashinfer-h3[bench]" in err


def test_sampled_oracle_matches_the_full_oracle() -> None:
    from flashinfer_h3.reference import attention_oracle

    g = torch.Generator().manual_seed(3)
    bounds = [0, 70, 70, 300]
    q, k, v = (torch.randn(300, 2, 128, generator=g).bfloat16() for _ in range(3))
    full = attention_oracle(q, k, v, torch.tensor(bounds, dtype=torch.int32),
                            cu_seqlens_host=bounds)
    sampled = benchtools.sampled_oracle(q, k, v, bounds, rows_per_segment=20, seed=1)
    assert len(sampled.rows) == 40 and sampled.rows.unique().numel() == 40
    assert torch.allclose(sampled.out, full.float()[sampled.rows], atol=2e-2, rtol=0)
    assert sampled.rel_l2(full) < 1e-2
    noisy = full.float() + 0.1 * torch.randn(full.shape, generator=g)
    assert 0.05 < sampled.rel_l2(noisy) < 1.0
    assert sampled.rel_l2(torch.full_like(full, float("nan"))) == float("inf")


def _payload() -> dict:
    runs = []
    for name in ("h3-10s", "h3-mix"):
        p = PRESETS[name]
        runs.append({
            "preset": name, "lengths": list(p.lengths), "heads": p.heads, "flops": 1e12,
            "results": [
                {"name": "flashinfer_h3 nvfp4", "ms": 20.0, "tflops": 50.0, "rel_l2": 0.19},
                {"name": "torch SDPA cuDNN bf16", "ms": 40.0, "tflops": 25.0, "rel_l2": 0.004},
                {"name": "SageAttention", "ms": None, "tflops": None, "rel_l2": None,
                 "error": "ImportError: x"},
            ],
        })
    return {"flashinfer_h3": "0.1.0", "device": "NVIDIA H200", "versions": {"torch": "2.13"},
            "runs": runs}


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra")
    out = tmp_path / "bench.png"
    benchtools.plot(_payload(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@no_gpu
def test_bench_cpu_writes_json_with_accuracy_and_a_plot(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra")
    report, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--op", "fp8", "--json", str(report), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "segments [1,000, 537] = 1,537 tokens x 4 heads x 128" in out
    assert "[1/1] fp8 reference (CPU): running" in out and "rel L2 vs FP32 oracle" in out
    data = json.loads(report.read_text())
    assert data["preset"] == "small" and [r["preset"] for r in data["runs"]] == ["small"]
    (row,) = data["results"]
    assert 0 < row["rel_l2"] <= 0.06  # SPEC 5's FP8 bar
    assert {"date", "versions", "iters", "warmup", "seed"} <= set(data)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_markdown_table_of_a_bench_json() -> None:
    text = benchtools.markdown_table({**_payload(), "date": "2026-12-01", "iters": 10,
                                      "warmup": 2, "seed": 0})
    assert "NVIDIA H200, 2026-12-01; torch 2.13; median of 10 runs" in text
    assert "| h3-10s (61,440 x 56) | flashinfer_h3 nvfp4 | 20.000 | 50.0 | 2.00 | 0.1900 |" in text
    assert "| h3-mix (61,261 x 56) | SageAttention | n/a | | | ImportError: x |" in text


def test_markdown_table_says_the_rounds() -> None:
    base = {**_payload(), "date": "2026-12-02", "iters": 10, "warmup": 2, "seed": 0}
    assert "rounds" not in benchtools.markdown_table(base).splitlines()[0]
    text = benchtools.markdown_table({**base, "rounds": 3})
    assert "median of 10 runs after 2 warm-up, every row timed in 3 rounds in turn" in text
    text = benchtools.markdown_table({**base, "rounds": 3, "warmup_ms": 1000.0})
    assert "after 2 warm-up (and 1000 ms of them), every row timed in 3 rounds in turn" in text


def test_rounds_summary() -> None:
    # The benchmark scripts' per-row line: median ms, (max - min) / median, median clock and
    # power only when every round sampled them.
    ms, spread, clocks = benchtools.rounds_summary([(2.0, 1700.0, 690.0), (2.4, 1750.0, 700.0),
                                                    (2.2, 1800.0, 695.0)])
    assert ms == 2.2 and abs(spread - 0.4 / 2.2) < 1e-12
    assert clocks == ", SM clock 1750 MHz, 695 W"
    assert benchtools.rounds_summary([(1.0, 1700.0, 690.0), (3.0, None, None)])[2] == ""


def test_round_orders() -> None:
    # Every round times every row once; round r starts at row r; and a row's predecessor
    # changes from round to round (a cyclic shift would keep it: the bench of 2026-12-06 timed
    # its NVFP4 whole-call row right after cuDNN FP8 in every round).
    assert benchtools.round_order(4, 0) == [0, 1, 2, 3]
    assert benchtools.round_order(8, 1) == [1, 4, 7, 2, 5, 0, 3, 6]  # stride 3
    assert benchtools.round_order(0, 3) == [] and benchtools.round_order(1, 5) == [0]
    for n in (2, 3, 5, 8, 9):
        orders = [benchtools.round_order(n, r) for r in range(n)]
        assert all(sorted(o) == list(range(n)) for o in orders)
        assert {o[0] for o in orders} == set(range(n))
    orders = [benchtools.round_order(8, r) for r in range(3)]  # the bench's 8 rows, 3 rounds
    predecessors = [{o[i]: o[i - 1] for i in range(1, 8)} for o in orders]
    for row in range(8):
        seen = [p[row] for p in predecessors if row in p]
        assert len(seen) == len(set(seen)), (row, seen)


def test_time_cuda_warms_up_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # _time_cuda keeps calling untimed until warmup_ms has passed (at least `warmup` calls), then
    # times `iters` calls; the clock here is a fake that advances 100 ms a call.
    import flashinfer_h3.__main__ as cli

    calls: list[str] = []
    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self) -> None:
            self.t = clock[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: FakeEvent) -> float:
            return (end.t - self.t) * 1e3

    def fn() -> None:
        calls.append("call")
        clock[0] += 0.1

    monkeypatch.setattr(cli.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert cli._time_cuda(fn, iters=3, warmup=2, warmup_ms=550.0) == pytest.approx(100.0)
    assert len(calls) == 6 + 3  # 0.0 .. 0.5 s is under 550 ms: six untimed calls, then three
    calls.clear()
    clock[0] = 0.0
    cli._time_cuda(fn, iters=1, warmup=2, warmup_ms=0.0)
    assert len(calls) == 2 + 1
    # No warm-up at all: the GPU is still synchronised before the first timed call (a whole
    # call's host work must not hide behind work queued before it), and `during` (the clock
    # sampler of _timed) is entered around the timed calls only.
    calls.clear()
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))

    class During:
        def __enter__(self) -> None:
            events.append(f"enter after {len(calls)} calls")

        def __exit__(self, *exc: object) -> None:
            events.append(f"exit after {len(calls)} calls")

    cli._time_cuda(fn, iters=2, warmup=0, warmup_ms=0.0, during=During())
    assert len(calls) == 2
    assert events == ["sync", "enter after 0 calls", "exit after 2 calls"]
    calls.clear()
    events.clear()
    cli._time_cuda(fn, iters=1, warmup=1, warmup_ms=0.0, during=During())
    assert events == ["sync", "sync", "enter after 1 calls", "exit after 2 calls"]


def test_bench_shapes() -> None:
    # The benchmark scripts' --preset and --shape together (bench_energy.py and the others).
    assert benchtools.bench_shapes("small, h3-mix", ["4097:1"], PRESETS) == [
        ("small", PRESETS["small"].lengths, PRESETS["small"].heads),
        ("h3-mix", PRESETS["h3-mix"].lengths, PRESETS["h3-mix"].heads),
        ("4097:1", (4097,), 1),
    ]
    assert benchtools.bench_shapes("", [], PRESETS) == []
    assert benchtools.bench_shapes(None, [], PRESETS) == []
    with pytest.raises(ValueError, match="^--preset: unknown preset 'h3-11s'"):
        benchtools.bench_shapes("h3-11s", [], PRESETS)
    with pytest.raises(ValueError, match="^--shape: expected LENGTHS:HEADS"):
        benchtools.bench_shapes(None, ["30720*2"], PRESETS)


def test_parse_shape() -> None:
    # The benchmark scripts' --shape (bench_wgmma_variants.py, bench_call_breakdown.py).
    assert benchtools.parse_shape("30720*2,333:56") == ((30720, 30720, 333), 56)
    assert benchtools.parse_shape("4097:1") == ((4097,), 1)
    for bad in ("30720*2", "30720:0", "a:56", "-1:2", "30720*x:56", ":56", "30720*0:56",
                "5,30720*-3:56"):
        with pytest.raises(ValueError, match="LENGTHS:HEADS"):
            benchtools.parse_shape(bad)
