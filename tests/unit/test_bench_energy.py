"""The joules-a-call helpers of benchmarks/bench_energy.py (benchtools.EnergyMeter,
energy_per_call) and the benchmark scripts' build flags, on the CPU: a simulated energy counter
that updates every 50 ms stands for NVML's."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from flashinfer_h3 import benchtools

ROOT = Path(__file__).resolve().parents[2]


class _Gpu:
    """Simulated time (s) and a counter of ``watts`` refreshed every ``period`` s, as NVML's."""

    def __init__(self, watts: float = 700.0, period: float = 0.05, call_s: float = 0.1) -> None:
        self.t, self.watts, self.period, self.call_s = 0.0, watts, period, call_s

    def clock(self) -> float:
        self.t += 1e-4  # each look at the clock (a spin of the wait) takes a little time
        return self.t

    def read(self) -> float:
        return self.watts * self.period * math.floor(self.t / self.period)

    def call(self) -> None:
        self.t += self.call_s


def test_energy_per_call_on_a_simulated_counter() -> None:
    gpu = _Gpu()
    window = benchtools.energy_per_call(gpu.call, gpu, 1.0, lambda: None, clock=gpu.clock)
    assert window is not None
    assert window.calls == 10
    # The window runs from one counter update to another: its energy is the power times its
    # length exactly, and the calls fill it up to the tail before the last update.
    assert window.joules == pytest.approx(700.0 * window.seconds, rel=1e-9)
    assert window.watts == pytest.approx(700.0)
    assert 1.0 <= window.seconds < 1.0 + 0.1 + 0.05 + 0.01
    assert window.joules_per_call == pytest.approx(window.joules / 10)
    assert window.ms_per_call == pytest.approx(1e3 * window.seconds / 10)


def test_energy_per_call_without_a_counter() -> None:
    class Missing:
        def read(self) -> None:
            return None

    gpu = _Gpu()
    missing = benchtools.energy_per_call(gpu.call, Missing(), 1.0, lambda: None, clock=gpu.clock)
    assert missing is None

    class Frozen:  # a counter that never updates
        def read(self) -> float:
            return 5.0

    frozen = benchtools.energy_per_call(gpu.call, Frozen(), 1.0, lambda: None, clock=gpu.clock)
    assert frozen is None


def test_energy_meter_reads_joules_or_none() -> None:
    # No NVML here (CI) gives None; with a GPU, a positive count of joules since the driver loaded.
    value = benchtools.EnergyMeter(0).read()
    assert value is None or value > 0


def test_parse_build_flags() -> None:
    assert benchtools.parse_build_flags("kv_copies=0, q_in_kernel=2") == {"kv_copies": 0,
                                                                          "q_in_kernel": 2}
    assert benchtools.parse_build_flags("") == {}
    for bad in ("kv_copies", "kv_copies=x", "=1", "a=1.5"):
        with pytest.raises(ValueError, match="FLAG=INTEGER"):
            benchtools.parse_build_flags(bad)


@pytest.mark.parametrize("argv,message", [
    (["--seconds", "0"], "--seconds must be > 0"),
    (["--fp8-build", "kv_copies"], "--fp8-build: expected FLAG=INTEGER"),
    (["--preset", "h3-11s"], "unknown preset 'h3-11s'"),
    (["--op", "int8"], "unknown op 'int8'"),
])
def test_bench_energy_options(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_energy.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert message in done.stderr
