"""``python -m flashinfer_h3 bench``'s "kernel only" rows, without a GPU: a fake kernel backend
(built with the real ``prepass_attention_launcher``, so that ``launch.attention_only`` is the one
the kernel backends have) runs behind the operator's real call path on the CPU, and the GPU
bench runs on CPU tensors with a fake timer. Checked: the kernel-only row is timed on
``attention_only`` alone after one whole call with the same plan and workspace views, its
accuracy comes from that output, its JSON keys, its absence for the reference backend, and the
plot and markdown table with the new row."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import flashinfer_h3.__main__ as cli
from flashinfer_h3 import backends, benchtools, diffusion_ops
from flashinfer_h3.reference import attention_oracle

WHOLE_MS, KERNEL_MS, PEER_MS = 4.0, 3.0, 10.0


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: Sequence[int],
           memo: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """The exact attention (FP32), computed once per input of ``memo``'s owner."""
    key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape), tuple(bounds))
    if key not in memo:
        cu = torch.tensor(bounds, dtype=torch.int32)
        memo[key] = attention_oracle(q, k, v, cu, cu_seqlens_host=bounds)
    return memo[key]


class FakeKernel:
    """A kernel backend of ``op`` whose pre-pass computes the exact attention into a store keyed
    by the workspace (the "operands" it leaves there) and whose attention kernel copies it out.
    ``broken_alone``: the attention kernel run without a pre-pass just before it halves its
    output (the accuracy column must then show the kernel-only output, not the whole call's)."""

    def __init__(self, op: str, *, broken_alone: bool = False) -> None:
        self.calls: list[str] = []
        self.store: dict[int, torch.Tensor] = {}
        self.memo: dict[tuple, torch.Tensor] = {}
        self.broken_alone = broken_alone
        backend = backends.Backend(
            f"fake_{op}", op, backends.KERNEL, lambda module, b: self.launch, module=op,
            workspace=op, capturable=True, archs=("sm_90a",),
        )
        self.launch = backends.prepass_attention_launcher(self.quantize, self.attention,
                                                          self.derive)
        self.prepared = backends.Prepared(backend, self.launch, torch.device("cpu"))

    @staticmethod
    def derive(plan: Any, views: tuple[torch.Tensor, ...]) -> Any:
        return (views, plan.host.bounds), (views,), ()

    def quantize(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 views: tuple[torch.Tensor, ...], bounds: Sequence[int]) -> None:
        self.calls.append("pre-pass")
        self.store[views[0].data_ptr()] = _exact(q, k, v, bounds, self.memo)

    def attention(self, out: torch.Tensor, views: tuple[torch.Tensor, ...],
                  scale: float) -> None:
        alone = not self.calls or self.calls[-1] != "pre-pass"
        self.calls.append("attention")
        result = self.store[views[0].data_ptr()]  # KeyError: no pre-pass filled this workspace
        out.copy_(result * 0.5 if alone and self.broken_alone else result)


def _reference(op: str) -> backends.Prepared:
    """The reference backend's descriptor with a cheap launch (no ``attention_only``)."""

    memo: dict[tuple, torch.Tensor] = {}

    def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               scale: float, bounds: tuple[int, ...], plan: Any, views: Any) -> None:
        out.copy_(_exact(q, k, v, bounds, memo))

    return backends.Prepared(backends.get(op, "reference"), launch, torch.device("cpu"))


def _inputs(tokens: Sequence[int] = (300, 0, 77), heads: int = 2) -> tuple[Any, ...]:
    return cli._inputs(tokens, heads, "cpu", 0)


def _use(monkeypatch: pytest.MonkeyPatch, table: dict[str, backends.Prepared]) -> None:
    monkeypatch.setattr(diffusion_ops, "_backend", lambda op, device: table[op])


# ---------------------------------------------------------------------------------------------
# benchtools.kernel_only_peer
# ---------------------------------------------------------------------------------------------


def test_kernel_only_times_attention_only_after_one_whole_call(monkeypatch) -> None:
    fake = FakeKernel("fp8")
    _use(monkeypatch, {"fp8": fake.prepared})
    q, k, v, _, bounds = _inputs()
    out = torch.empty_like(q)
    kernel = benchtools.kernel_only_peer("fp8", q, k, v, bounds, out)
    assert kernel is not None
    assert kernel.label == "flashinfer_h3 fp8 [fake_fp8] kernel only (no pre-pass)"
    assert kernel.backend == "fake_fp8" and kernel.scale == diffusion_ops.DEFAULT_SOFTMAX_SCALE
    with pytest.raises(RuntimeError, match="before prime"):
        kernel.run()
    kernel.prime()
    assert fake.calls == ["pre-pass", "attention"]  # one whole call
    assert out.isnan().all()  # its output is kept aside, not left for the accuracy column
    result = kernel.run()
    for _ in range(3):
        kernel.run()
    assert fake.calls == ["pre-pass", "attention"] + ["attention"] * 4  # no more pre-passes
    assert result is out and kernel.matches_whole_call(result)
    assert kernel.whole_call is None  # the copy is dropped after the check
    # The plan and views are those of the operator's own eager call (same cache entries).
    from flashinfer_h3.plan import PLANS

    assert kernel.plan is PLANS.lookup(tuple(bounds), q.shape[1], q.device)


def test_prepass_only_runs_the_pre_pass_alone(monkeypatch) -> None:
    """``launch.prepass_only`` (benchmarks/bench_call_breakdown.py) runs the quantisation
    launches and not the attention kernel; an attention_only after it reads what it left."""
    fake = FakeKernel("nvfp4")
    _use(monkeypatch, {"nvfp4": fake.prepared})
    q, k, v, _, bounds = _inputs((129, 16), heads=1)
    kernel = benchtools.kernel_only_peer("nvfp4", q, k, v, bounds, torch.empty_like(q))
    assert kernel is not None
    kernel.prime()
    args = (kernel.q, kernel.k, kernel.v, kernel.out, kernel.scale, kernel.bounds, kernel.plan,
            kernel.views)
    fake.launch.prepass_only(*args)
    assert fake.calls == ["pre-pass", "attention", "pre-pass"]
    fake.launch.attention_only(*args)
    assert fake.calls[-1] == "attention" and kernel.matches_whole_call(kernel.out)


def test_kernel_only_reports_an_output_that_differs_from_the_whole_call(monkeypatch) -> None:
    fake = FakeKernel("nvfp4", broken_alone=True)
    _use(monkeypatch, {"nvfp4": fake.prepared})
    q, k, v, _, bounds = _inputs()
    kernel = benchtools.kernel_only_peer("nvfp4", q, k, v, bounds, torch.empty_like(q))
    assert kernel is not None
    kernel.prime()
    assert not kernel.matches_whole_call(kernel.run())


def test_no_kernel_only_for_the_reference_or_without_a_backend(monkeypatch) -> None:
    q, k, v, _, bounds = _inputs()
    _use(monkeypatch, {"fp8": _reference("fp8")})
    assert benchtools.kernel_only_backend("fp8", q.device) is None
    assert benchtools.kernel_only_peer("fp8", q, k, v, bounds, torch.empty_like(q)) is None
    # The registered reference launcher itself has no attention_only.
    real = backends.get("fp8", "reference")
    assert not hasattr(backends.reference_launcher(None, real), "attention_only")

    def unavailable(op: str, device: Any) -> backends.Prepared:
        raise RuntimeError("no fp8 backend runs on compute capability 8.0")

    monkeypatch.setattr(diffusion_ops, "_backend", unavailable)
    assert benchtools.kernel_only_backend("fp8", q.device) is None


# ---------------------------------------------------------------------------------------------
# the GPU bench, on CPU tensors
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu_bench(monkeypatch) -> Callable[..., dict]:
    """``run(table, tmp_path, *argv) -> the JSON``: ``bench`` through its GPU path on the CPU, the
    operators' real call path with the backends of ``table``, SDPA peers replaced by the exact
    attention, a timer that runs every timed call and reports WHOLE_MS for a measurement whose
    calls ran a pre-pass, KERNEL_MS for one whose calls ran only attention kernels, PEER_MS
    otherwise."""
    real_inputs = cli._inputs
    monkeypatch.setattr(cli, "_has_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cli, "_inputs", lambda lengths, heads, device, seed:
                        real_inputs(lengths, heads, "cpu", seed))
    monkeypatch.setattr(diffusion_ops, "check_cuda", lambda q: None)  # CPU tensors, real path
    monkeypatch.setattr(benchtools, "sageattention_available", lambda: False)
    monkeypatch.setattr(benchtools, "cudnn_frontend_available", lambda: False)

    memo: dict[tuple, torch.Tensor] = {}

    def exact_peer(q: Any, k: Any, v: Any, bounds: Sequence[int], backend: Any) -> Any:
        return lambda: _exact(q, k, v, bounds, memo), lambda result: result

    monkeypatch.setattr(benchtools, "sdpa_peer", exact_peer)
    fakes: list[FakeKernel] = []

    def timer(fn: Callable[[], Any], iters: int, warmup: int, warmup_ms: float = 0.0,
              during: Any = None) -> float:
        seen = [len(f.calls) for f in fakes]
        for _ in range(warmup + iters):
            fn()
        new = [c for f, n in zip(fakes, seen, strict=True) for c in f.calls[n:]]
        return WHOLE_MS if "pre-pass" in new else KERNEL_MS if new else PEER_MS

    monkeypatch.setattr(cli, "_time_cuda", timer)

    def run(table: dict[str, Any], tmp_path: Path, *argv: str) -> dict:
        fakes.extend(f for f in table.values() if isinstance(f, FakeKernel))
        prepared = {op: f.prepared if isinstance(f, FakeKernel) else f for op, f in table.items()}
        _use(monkeypatch, prepared)
        monkeypatch.setattr(cli, "_backend_label", lambda op: prepared[op].backend.label)
        report = tmp_path / "bench.json"
        assert cli.main(["bench", "--preset", "small", "--iters", "2", "--warmup", "1",
                         "--json", str(report), *argv]) == 0
        return json.loads(report.read_text())

    return run


def test_bench_has_a_kernel_only_row_per_kernel_backend(fake_gpu_bench, tmp_path,
                                                        capsys) -> None:
    nvfp4 = FakeKernel("nvfp4")
    data = fake_gpu_bench({"nvfp4": nvfp4, "fp8": _reference("fp8")}, tmp_path)
    out = capsys.readouterr().out
    (run,) = data["runs"]
    rows = {r["name"]: r for r in run["results"]}
    kernel_label = "flashinfer_h3 nvfp4 [fake_nvfp4] kernel only (no pre-pass)"
    assert list(rows) == [
        "flashinfer_h3 nvfp4 [fake_nvfp4 (kernel)]",
        kernel_label,  # right after its whole call
        "flashinfer_h3 fp8 [reference (torch emulation)]",  # no kernel-only row
        "torch SDPA cuDNN bf16",
        "torch SDPA flash bf16",
    ]
    whole, kernel = rows["flashinfer_h3 nvfp4 [fake_nvfp4 (kernel)]"], rows[kernel_label]
    assert whole["ms"] == WHOLE_MS and kernel["ms"] == KERNEL_MS  # timed: attention_only alone
    assert whole["scope"] == "whole call" and whole["op"] == "nvfp4"
    assert {k: kernel[k] for k in ("op", "scope", "backend", "matches_whole_call")} == {
        "op": "nvfp4", "scope": "kernel only", "backend": "fake_nvfp4",
        "matches_whole_call": True}
    flops = run["flops"]
    assert math.isclose(kernel["tflops"], flops / (KERNEL_MS * 1e-3) / 1e12)
    assert kernel["vs_cudnn"] == PEER_MS / KERNEL_MS and kernel["vs_flash"] == PEER_MS / KERNEL_MS
    assert kernel["rel_l2"] == whole["rel_l2"] and kernel["rel_l2"] < 1e-2  # the exact fake
    fp8 = rows["flashinfer_h3 fp8 [reference (torch emulation)]"]
    assert fp8["scope"] == "whole call" and "matches_whole_call" not in fp8
    # One whole call per measurement of the whole-call row (1 accuracy + 1 warm-up + 2 timed),
    # then one to prime the kernel-only row, whose 4 calls run the attention kernel alone.
    assert nvfp4.calls == ["pre-pass", "attention"] * 5 + ["attention"] * 4
    # Progress: one line per row, counted in the total announced first.
    assert "5 implementation(s)" in out and f"[2/5] small {kernel_label}: 3.000 ms" in out
    assert "kernel only': the pre-pass excluded" in out
    assert ("nvfp4 [fake_nvfp4]: the whole call takes 4.000 ms, its attention kernel 3.000 ms: "
            "pre-pass and host work 1.000 ms (25% of the call)") in out
    assert out.count("pre-pass and host work") == 1  # none for the reference


def test_bench_kernel_only_accuracy_is_its_own_output(fake_gpu_bench, tmp_path, capsys) -> None:
    data = fake_gpu_bench({"fp8": FakeKernel("fp8", broken_alone=True)}, tmp_path, "--op",
                          "fp8")
    out = capsys.readouterr().out
    whole, kernel = data["results"][:2]
    assert kernel["scope"] == "kernel only" and kernel["matches_whole_call"] is False
    assert whole["rel_l2"] < 1e-2 and 0.45 < kernel["rel_l2"] < 0.55  # the halved output
    assert "WARNING: its output differs from the whole call's" in out


def test_bench_json_plot_and_table_with_kernel_only_rows(fake_gpu_bench, tmp_path,
                                                         capsys) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs the bench extra")
    png = tmp_path / "bench.png"
    data = fake_gpu_bench({"nvfp4": FakeKernel("nvfp4"), "fp8": FakeKernel("fp8")},
                          tmp_path, "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = [r["name"] for r in data["results"]]
    assert names[:4] == [
        "flashinfer_h3 nvfp4 [fake_nvfp4 (kernel)]",
        "flashinfer_h3 nvfp4 [fake_nvfp4] kernel only (no pre-pass)",
        "flashinfer_h3 fp8 [fake_fp8 (kernel)]",
        "flashinfer_h3 fp8 [fake_fp8] kernel only (no pre-pass)",
    ]
    table = benchtools.markdown_table(data)
    assert ("| small (1,537 x 4) | flashinfer_h3 fp8 [fake_fp8] kernel only (no pre-pass) | "
            "3.000 |") in table


# ---------------------------------------------------------------------------------------------
# --rounds and the GPU's state (SM clock, power, temperature) per row
# ---------------------------------------------------------------------------------------------


def test_bench_rounds_time_every_row_again_and_report_their_median(fake_gpu_bench, tmp_path,
                                                                   monkeypatch, capsys) -> None:
    """With --rounds 3 every row is timed three times in turn (the kernel-only row primed again
    before each round: another row's call may have reused the workspace) and reports the median
    of its rounds; the rounds' times go into the JSON."""
    nvfp4 = FakeKernel("nvfp4")
    offsets = [0.0, 2.0, 1.0]  # round r of a row takes base + offsets[r]
    # The kernel-only row's rounds in another order (the same median), so that its per-round
    # differences from the whole call's are not all the medians' difference.
    kernel_offsets = [1.0, 2.0, 0.0]
    seen: dict[str, int] = {}

    def timer(fn: Callable[[], Any], iters: int, warmup: int, warmup_ms: float = 0.0,
              during: Any = None) -> float:
        before = len(nvfp4.calls)
        for _ in range(warmup + iters):
            fn()
        new = nvfp4.calls[before:]
        kind = "whole" if "pre-pass" in new else "kernel" if new else "peer"
        base = {"whole": WHOLE_MS, "kernel": KERNEL_MS, "peer": PEER_MS}[kind]
        row = kind if kind != "peer" else str(id(fn))  # each peer row counts its own rounds
        r = seen.get(row, 0)
        seen[row] = r + 1
        return base + (kernel_offsets if kind == "kernel" else offsets)[r % 3]

    monkeypatch.setattr(cli, "_time_cuda", timer)  # replaces the fixture's
    data = fake_gpu_bench({"nvfp4": nvfp4, "fp8": _reference("fp8")}, tmp_path, "--op", "nvfp4",
                          "--rounds", "3")
    out = capsys.readouterr().out
    assert data["rounds"] == 3
    rows = {r["name"]: r for r in data["results"]}
    whole = rows["flashinfer_h3 nvfp4 [fake_nvfp4 (kernel)]"]
    kernel = rows["flashinfer_h3 nvfp4 [fake_nvfp4] kernel only (no pre-pass)"]
    assert whole["round_ms"] == [WHOLE_MS, WHOLE_MS + 2, WHOLE_MS + 1]
    assert whole["ms"] == WHOLE_MS + 1 and kernel["ms"] == KERNEL_MS + 1
    assert math.isclose(kernel["tflops"], data["flops"] / ((KERNEL_MS + 1) * 1e-3) / 1e12)
    assert kernel["vs_cudnn"] == (PEER_MS + 1) / (KERNEL_MS + 1)
    assert kernel["matches_whole_call"] is True and kernel["rel_l2"] < 1e-2
    # Round 1 as without --rounds. Rounds 2 and 3 in benchtools.round_order's orders of the 4
    # rows (whole call, kernel only, cuDNN, flash): round 2 [1, 0, 3, 2] primes the kernel-only
    # row (one whole call) and times its 3 attention-only calls, then the whole call's 3 calls;
    # round 3 [2, 3, 0, 1] the whole call first, then the kernel-only row.
    first = ["pre-pass", "attention"] * 5 + ["attention"] * 4
    kernel_row = ["pre-pass", "attention"] + ["attention"] * 3
    whole_row = ["pre-pass", "attention"] * 3
    assert nvfp4.calls == first + kernel_row + whole_row + whole_row + kernel_row
    assert "in 3 rounds" in out and "round 3/3 small flashinfer_h3 nvfp4" in out
    assert kernel["round_ms"] == [KERNEL_MS + 1, KERNEL_MS + 2, KERNEL_MS]
    # The medians differ by 1 ms; round by round the differences are 0, 1 and 2 ms.
    assert ("pre-pass and host work 1.000 ms (20% of the call); round by round 0.000 to 2.000 ms"
            in out)
    assert "gpu" not in kernel  # no nvidia-smi here


class _FakeSmi:
    """subprocess.Popen of ``nvidia-smi ... -lms``: communicate() gives these lines."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.terminated = False

    def terminate(self) -> None:
        self.terminated = True

    def communicate(self) -> tuple[str, str]:
        return "\n".join(self.lines) + "\n", ""


def test_gpu_sampler_medians_drop_the_warm_up_samples(monkeypatch) -> None:
    import shutil
    import subprocess

    started: list[list[str]] = []
    smi = _FakeSmi(["1980, 300.0, 40", "1700, 710.0, 41",  # the warm-up start: dropped
                    "1845, 690.5, 60", "[N/A], 1.0, 1", "1860, 680.0, 62", "1830, 700.0, 61",
                    "1845, 6"])  # a line cut off by terminate()

    def popen(cmd: list[str], **kwargs: Any) -> _FakeSmi:
        started.append(cmd)
        return smi

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(subprocess, "Popen", popen)
    with benchtools.GpuSampler(3) as sampler:
        assert sampler.state is None
    assert smi.terminated
    assert started[0][:3] == ["nvidia-smi", "-i", "3"] and "-lms" in started[0]
    assert sampler.state == benchtools.GpuState(1845.0, 690.5, 61.0)
    assert "SM 1845 MHz, 690 W, 61 C" in cli._state_text(sampler.state)


def test_gpu_sampler_without_nvidia_smi(monkeypatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with benchtools.GpuSampler(0) as sampler:
        pass
    assert sampler.state is None and cli._state_text(None) == ""


def test_nvidia_smi_device_follows_cuda_visible_devices(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert benchtools.nvidia_smi_device(1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert benchtools.nvidia_smi_device(0) == "3" and benchtools.nvidia_smi_device(1) == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a1f0c2e-0000-1111-2222-333344445555")
    assert benchtools.nvidia_smi_device(0) == "GPU-8a1f0c2e-0000-1111-2222-333344445555"
