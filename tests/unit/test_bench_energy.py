"""The joules-a-call helpers of benchmarks/bench_energy.py (benchtools.EnergyMeter,
energy_per_call) and the benchmark scripts' build flags, on the CPU: a simulated GPU that draws
700 W while a call runs and 100 W otherwise, with an energy counter refreshed every 50 ms, stands
for NVML's."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashinfer_h3 import benchtools

ROOT = Path(__file__).resolve().parents[2]


class _Gpu:
    """Simulated time (s) and energy (J): ``busy_w`` during a call, ``idle_w`` otherwise (the
    polling of the wait included); ``read()`` gives the energy at the last refresh instant."""

    def __init__(self, busy_w: float = 700.0, idle_w: float = 100.0, period: float = 0.05,
                 call_s: float = 0.1) -> None:
        self.busy_w, self.idle_w, self.period, self.call_s = busy_w, idle_w, period, call_s
        self.t = 0.0
        self.history = [(0.0, 0.0, idle_w)]  # (time, energy, power from then on)

    def _advance(self, dt: float, watts: float) -> None:
        """``dt`` seconds at ``watts``, then idle again."""
        self.history.append((self.t, self.energy_at(self.t), watts))
        self.t += dt
        self.history.append((self.t, self.energy_at(self.t), self.idle_w))

    def energy_at(self, when: float) -> float:
        for t0, e0, w0 in reversed(self.history):  # the latest state change at or before
            if t0 <= when:
                return e0 + w0 * (when - t0)
        raise AssertionError("before the simulation's start")

    def clock(self) -> float:
        self._advance(1e-4, self.idle_w)  # each look at the clock takes a little idle time
        return self.t

    def read(self) -> float:
        return self.energy_at(self.period * math.floor(self.t / self.period))

    def call(self) -> None:
        self._advance(self.call_s, self.busy_w)


def test_energy_per_call_on_a_simulated_gpu() -> None:
    gpu = _Gpu()
    window = benchtools.energy_per_call(gpu.call, gpu, 1.0, lambda: None, clock=gpu.clock)
    assert window is not None
    assert window.calls == 10
    # The busy time is the calls' own (each call and the clock look after it), not the idle
    # tail up to the counter's next refresh.
    assert window.ms_per_call == pytest.approx(100.0, rel=2e-3)
    # The joules are the calls' 70 J each plus the idle tail (at most one 50 ms refresh period at
    # 100 W over ten calls: +0.5 J a call) and the clock looks at idle power.
    assert 70.0 <= window.joules_per_call <= 70.0 + 0.5 + 0.1
    assert 700.0 <= window.watts <= 700.0 * 1.01


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

    class OnceOnly:  # updates once (the window opens), then stops: no end, no window
        def __init__(self) -> None:
            self.reads = 0

        def read(self) -> float:
            self.reads += 1
            return 0.0 if self.reads < 3 else 1.0

    once = benchtools.energy_per_call(gpu.call, OnceOnly(), 0.5, lambda: None, clock=gpu.clock,
                                      update_limit_s=0.2)
    assert once is None


def test_energy_meter_reads_joules_or_none() -> None:
    # Without NVML (CI) None, and close() is harmless; with a GPU, joules since the driver loaded.
    meter = benchtools.EnergyMeter(0)
    value = meter.read()
    assert value is None or value > 0
    meter.close()
    assert meter.read() is None


def test_parse_build_flags() -> None:
    assert benchtools.parse_build_flags("kv_copies=0, q_in_kernel=2") == {"kv_copies": 0,
                                                                          "q_in_kernel": 2}
    assert benchtools.parse_build_flags("stages=-1") == {"stages": -1}
    assert benchtools.parse_build_flags("") == {}
    for bad in ("kv_copies", "kv_copies=x", "=1", "a=1.5", "a=\u00b2", "a b=1"):
        with pytest.raises(ValueError, match="FLAG=INTEGER"):
            benchtools.parse_build_flags(bad)
    with pytest.raises(ValueError, match="given twice"):
        benchtools.parse_build_flags("a=1,a=2")
    # With the op, checked against its Hopper module's flags (jit/modules.py).
    assert benchtools.parse_build_flags("delta=0,wide_consumers=0", "nvfp4") == {
        "delta": 0, "wide_consumers": 0}
    with pytest.raises(ValueError, match="module 'nvfp4_wgmma' has no flag 'delta_ffma'"):
        benchtools.parse_build_flags("delta_ffma=1", "nvfp4")
    with pytest.raises(ValueError, match="module 'fp8_wgmma' has no flag 'delta'"):
        benchtools.parse_build_flags("delta=0", "fp8")
    with pytest.raises(ValueError, match="register_usage_level"):
        benchtools.parse_build_flags("register_usage_level=11", "fp8")
    with pytest.raises(ValueError, match="no Hopper module for op 'bf16'"):
        benchtools.parse_build_flags("delta=0", "bf16")


@pytest.mark.parametrize("argv,message", [
    (["--seconds", "0"], "--seconds must be > 0"),
    (["--seconds", "nan"], "--seconds must be > 0"),
    (["--fp8-build", "kv_copies"], "--fp8-build: expected FLAG=INTEGER"),
    (["--nvfp4-build", "delta_ffma=1"],
     "--nvfp4-build: KernelConfig.flags: module 'nvfp4_wgmma' has no flag"),
    (["--preset", "h3-11s"], "unknown preset 'h3-11s'"),
    (["--op", "int8"], "unknown op 'int8'"),
])
def test_bench_energy_options(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_energy.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert message in done.stderr


def _bench_wgmma_variants() -> Any:
    """benchmarks/bench_wgmma_variants.py as a module (it imports torch at its top)."""
    pytest.importorskip("torch")
    path = ROOT / "benchmarks" / "bench_wgmma_variants.py"
    spec = importlib.util.spec_from_file_location("bench_wgmma_variants", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_variant_of_bench_wgmma_variants_is_a_valid_build() -> None:
    # Its builds are made on the device, after the inputs: a misspelt flag there would cost a
    # device call, so each row's flags are checked against its module's here (jit/modules.py).
    from flashinfer_h3.jit import KernelConfig

    module = _bench_wgmma_variants()
    assert set(module.VARIANTS) == set(benchtools.HOPPER_MODULES)
    for op, rows in module.VARIANTS.items():
        for name, flags in rows.items():
            config = KernelConfig(benchtools.HOPPER_MODULES[op][0], arch="sm_90a", flags=flags)
            assert dict(config.flags) == flags, name


def test_carry_cache_builds_what_the_record_times() -> None:
    # benchmarks/carry_cache.sh compiles, on the CPU, the benchmark builds that `h200_session.sh
    # record` times, so the device spends no time on them. The two scripts name the builds by the
    # same --only filter; a filter that matched nothing would build nothing, silently.
    carry = (ROOT / "benchmarks" / "carry_cache.sh").read_text()
    session = (ROOT / "benchmarks" / "h200_session.sh").read_text()
    carried = re.findall(r'--build-only --op (\w+) --only "([^"]+)"', carry)
    start = session.index("if [[ $what == record ]]")
    record = session[start:session.index("\nfi\n", start)]
    timed = re.findall(r'--op (\w+) --preset \S+\s*\\?\s*--only "([^"]+)"', record)
    assert carried and carried == timed, (carried, timed)

    module = _bench_wgmma_variants()
    for op, only in carried:
        builds = [flags for _, flags in module.selected_variants(op, only) if flags]
        assert len(builds) == len(only.split(",")), (op, only, builds)


def test_h200_session_refuses_an_unknown_mode(tmp_path: Path) -> None:
    # Its modes list is the set of modes it has a step for (plus `none`, the setup alone), and
    # a mode it lacks (a removed one, a typo) stops before the device session's setup spends
    # device time on a run that does nothing.
    path = ROOT / "benchmarks" / "h200_session.sh"
    session = path.read_text()
    listed = set(re.search(r'^modes=" (.*) "$', session, re.M).group(1).split())
    handled = set(re.findall(r"\$what == (\w+)", session))
    assert listed == handled | {"none"}
    done = subprocess.run(["bash", str(path), "boundary"], capture_output=True, text=True,
                          cwd=ROOT, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")})
    assert done.returncode == 2 and "unknown mode 'boundary'" in done.stderr
    assert not (tmp_path / "out").exists()
