"""The backend registry (flashinfer_h3/backends.py): resolution, choice, prepared launchers.

Pure logic: no GPU (the capability is faked where a device is needed) and no nvcc."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from flashinfer_h3 import backends
from flashinfer_h3.jit import UnsupportedArchError


@pytest.fixture(autouse=True)
def _no_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for env in backends.ENV_BACKEND.values():
        monkeypatch.delenv(env, raising=False)
    for op in backends.OPERATORS:
        backends.set_backend(op, None)
    backends.reset()
    yield
    for op in backends.OPERATORS:
        backends.set_backend(op, None)
    backends.reset()


def _noop_launcher(module, backend):
    return lambda *args: None


@pytest.fixture
def fp8_kernels() -> Iterator[None]:
    """The two FP8 kernel slots, registered the way their owners do (fake launchers for the ones
    that are not registered yet; a registered one is left as it is)."""
    added = []
    fp8 = {b.name for b in backends.backends("fp8")}
    if "mma_sync_fp8" not in fp8:
        added.append(backends.register(backends.Backend(
            "mma_sync_fp8", "fp8", backends.KERNEL, _noop_launcher, module="fp8",
            workspace="fp8", capturable=True, archs=("sm_90a", "sm_120a", "sm_121a"),
            auto=(("sm_120a", 10), ("sm_121a", 10), ("sm_90a", 10)),
        )))
    if "wgmma_fp8" not in fp8:
        added.append(backends.register(backends.Backend(
            "wgmma_fp8", "fp8", backends.KERNEL, _noop_launcher, module="fp8", workspace="fp8",
            capturable=True, archs=("sm_90a",), auto=(("sm_90a", 20),),
        )))
    yield
    for backend in reversed(added):
        backends.unregister("fp8", backend.name)


def test_registered_backends_say_what_runs() -> None:
    nvfp4 = {b.name: b for b in backends.backends("nvfp4")}
    assert set(nvfp4) >= {"mma_sync_fp4", "mma_sync_fp4_emulated", "reference"}
    native, emulated, ref = (nvfp4[n] for n in ("mma_sync_fp4", "mma_sync_fp4_emulated",
                                                 "reference"))
    assert native.kind == emulated.kind == "kernel" and ref.kind == "reference"
    assert native.module == emulated.module == "nvfp4"  # one source, two MMA layers
    assert native.workspace == emulated.workspace == "nvfp4" and ref.workspace is None
    assert native.capturable and emulated.capturable and not ref.capturable
    assert native.archs == ("sm_120a", "sm_121a") and emulated.archs == ("sm_90a",)
    assert ref.archs == () and ref.runs_on("sm_90a") and ref.runs_on("")
    assert ref.label == "reference (torch emulation)"
    assert native.label == "mma_sync_fp4 (kernel)"
    assert [b.name for b in backends.backends("fp8") if b.name == "reference"] == ["reference"]


@pytest.mark.parametrize("arch,nvfp4", [
    ("sm_90a", "wgmma_fp16_nvfp4"), ("sm_120a", "mma_sync_fp4"), ("sm_121a", "mma_sync_fp4"),
])
def test_auto_per_arch(arch: str, nvfp4: str) -> None:
    assert backends.resolve_for_arch("nvfp4", arch).name == nvfp4
    if not any(b.is_kernel for b in backends.backends("fp8")):
        assert backends.resolve_for_arch("fp8", arch).name == "reference"


def test_fp8_slots_take_auto_by_priority(fp8_kernels: None) -> None:
    assert backends.resolve_for_arch("fp8", "sm_90a").name == "wgmma_fp8"  # 20 > 10
    assert backends.resolve_for_arch("fp8", "sm_120a").name == "mma_sync_fp8"
    assert backends.resolve("fp8", (9, 0), "mma_sync_fp8").name == "mma_sync_fp8"
    with pytest.raises(RuntimeError, match=r"wgmma_fp8 needs compute capability 9\.0, but this "
                       r"GPU is 12\.0; the fp8 backends that run here: mma_sync_fp8, reference"):
        backends.resolve("fp8", (12, 0), "wgmma_fp8")


def test_registration_is_checked() -> None:
    def make(**kw):
        base = dict(name="x", op="fp8", kind="kernel", make_launcher=_noop_launcher,
                    module="fp8", workspace="fp8", archs=("sm_90a",))
        base.update(kw)
        return backends.Backend(**base)

    with pytest.raises(ValueError, match="unknown operator"):
        backends.register(make(op="bf16"))
    with pytest.raises(ValueError, match="kind"):
        backends.register(make(kind="fast"))
    with pytest.raises(ValueError, match="taken"):
        backends.register(make(name="reference"))
    with pytest.raises(ValueError, match="taken"):
        backends.register(make(name="auto"))
    with pytest.raises(ValueError, match="not in jit/modules.py"):
        backends.register(make(module="no_such_module"))
    with pytest.raises(ValueError, match="unknown arch"):
        backends.register(make(archs=("sm_80",)))
    with pytest.raises(ValueError, match="workspace"):
        backends.register(make(workspace=None))
    assert "x" not in {b.name for b in backends.backends("fp8")}


def test_unsupported_gpu() -> None:
    with pytest.raises(UnsupportedArchError, match=r"8\.0.*9\.0.*12\.0"):
        backends.resolve("nvfp4", (8, 0), "auto")
    assert backends.resolve("nvfp4", (8, 0), "reference").name == "reference"
    with pytest.raises(UnsupportedArchError, match=r"no kernels for GPUs of compute capability "
                       r"8\.0; supported compute capabilities: 9\.0"):
        backends.resolve("nvfp4", (8, 0), "mma_sync_fp4_emulated")


def test_choice_order_scoped_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backends.current_choice("fp8") == ("auto", "FLASHINFER_H3_FP8_BACKEND")
    monkeypatch.setenv("FLASHINFER_H3_FP8_BACKEND", " Reference ")
    assert backends.current_choice("fp8") == ("reference", "FLASHINFER_H3_FP8_BACKEND")
    backends.set_backend("nvfp4", "sm120_emulated")  # an alias is a valid choice
    assert backends.current_choice("nvfp4")[0] == "sm120_emulated"
    backends.set_backend("fp8", "auto")
    assert backends.current_choice("fp8") == ("auto", "set_backend('fp8', ...)")
    with backends.use_backend("fp8", "reference"):
        assert backends.current_choice("fp8") == ("reference", "use_backend('fp8', ...)")
        assert backends.current_choice("nvfp4")[0] == "sm120_emulated"
        with backends.use_backend("fp8", "auto"):
            assert backends.current_choice("fp8")[0] == "auto"
        assert backends.current_choice("fp8")[0] == "reference"
        seen = []
        t = threading.Thread(target=lambda: seen.append(backends.current_choice("fp8")[0]))
        t.start()
        t.join()
        assert seen == ["auto"]  # use_backend is per thread; set_backend is per process
    assert backends.current_choice("fp8")[0] == "auto"
    backends.set_backend("fp8", None)
    assert backends.current_choice("fp8")[0] == "reference"  # the env again


def test_choice_errors() -> None:
    with pytest.raises(ValueError, match=r"set_backend\('fp8', ...\): 'mma_sync_fp4' is not an?"
                       r" fp8 backend; expected one of auto, (\w+, )*reference"):
        backends.set_backend("fp8", "mma_sync_fp4")
    with pytest.raises(ValueError, match="unknown operator 'bf16'"):
        backends.set_backend("bf16", "auto")
    with pytest.raises(TypeError):
        backends.set_backend("fp8", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"use_backend\('nvfp4', ...\)"):
        with backends.use_backend("nvfp4", "fast"):
            pass


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """A GPU of a settable compute capability; JIT modules are never loaded."""
    exports = ("quantize_nvfp4", "attention_nvfp4", "quantize_fp8", "attention_fp8_mma_sync",
               "attention_fp8_wgmma")
    module = type("FakeModule", (), dict.fromkeys(exports))()
    state = {"cap": (9, 0), "loads": [], "module": module}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["cap"])
    import flashinfer_h3.jit as jit

    def fake_get_module(module, device=None):
        state["loads"].append(module)
        return state["module"]

    monkeypatch.setattr(jit, "get_module", fake_get_module)
    return state


def test_prepared_once_per_op_device_choice(fake_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda", 0)
    first = backends.prepared("fp8", dev)
    auto = backends.resolve_for_arch("fp8", "sm_90a")
    assert first.name == auto.name and first.workspace == auto.workspace
    assert backends.prepared("fp8", dev) is first
    with backends.use_backend("fp8", "reference"):
        scoped = backends.prepared("fp8", dev)
    assert scoped.name == "reference" and scoped.workspace is None and not scoped.capturable
    assert fake_gpu["loads"] == ([auto.module] if auto.module else [])  # the reference: none
    monkeypatch.setenv("FLASHINFER_H3_NVFP4_BACKEND", "reference")
    assert backends.prepared("nvfp4", dev).name == "reference"
    monkeypatch.setenv("FLASHINFER_H3_NVFP4_BACKEND", "mma_sync_fp4")
    with pytest.raises(RuntimeError, match=r"FLASHINFER_H3_NVFP4_BACKEND=mma_sync_fp4 needs "
                       r"compute capability 12\.x, but this GPU is 9\.0"):
        backends.prepared("nvfp4", dev)
    backends.set_backend("nvfp4", "reference")  # the process choice beats the env
    assert backends.prepared("nvfp4", dev).name == "reference"


def test_kernel_backend_loads_its_module(fake_gpu) -> None:
    fake_gpu["cap"] = (12, 0)
    p = backends.prepared("nvfp4", torch.device("cuda", 0))
    assert p.name == "mma_sync_fp4" and p.workspace == "nvfp4" and p.capturable
    assert fake_gpu["loads"] == ["nvfp4"]


def test_plan_args_are_bound_once_per_plan_and_views() -> None:
    made = []
    bound = backends.PlanArgs(lambda plan, views: made.append((plan, views)) or len(made))
    plan_a, plan_b, views = object(), object(), (torch.zeros(1),)
    assert bound.get(plan_a, views) == 1 and bound.get(plan_a, views) == 1
    assert bound.get(plan_b, views) == 2 and bound.get(plan_a, views) == 3
    assert bound.get(plan_a, (torch.zeros(1),)) == 4  # other views: derived again


def test_plan_args_keep_nothing_of_a_captured_call() -> None:
    """A captured call's plan and views are temporaries of the capture's pool: never cached
    (cudagraph trees refuse a graph whose pool holds tensors that outlive the call)."""
    made = []
    bound = backends.PlanArgs(lambda plan, views: made.append(plan) or len(made))
    captured = type("CapturedPlan", (), {"captured": True})()
    views = (torch.zeros(1),)
    assert bound.get(captured, views) == 1 and bound.get(captured, views) == 2
    assert bound._entry is None


class Recorder:
    """A fake kernel module: records every exported function's call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, args))

    def attention_fp8_wgmma_cluster_ctas(self) -> int:  # the FP8 Hopper build's query
        return 1


class FakePlan:
    """The parts of a Plan a launcher reads: the device tables, the FP8 Hopper kernel's item
    schedule and the used V columns."""

    args = ("seg_bounds", "vkey_start", "qblock_start", "qblocks")
    schedule = ("cta_begin", "cta_items")
    host = type("Host", (), {"vkey_start": (0, 64, 192)})()

    def schedule_for(self, cluster_ctas: int) -> tuple[str, str]:
        assert cluster_ctas == 1  # the production build's
        return self.schedule


def test_kernel_launchers_pass_the_documented_arguments() -> None:
    """Each kernel backend's launch: the pre-pass, then its attention kernel, with the
    arguments of docs/design.md (derived once per plan and views)."""

    plan = FakePlan()
    # (tables, the Hopper kernel's item counter, scale, tail, the kernel's leading arguments)
    expected_tail = {
        "mma_sync_fp4": (["seg_bounds", "vkey_start", "qblocks"], [], 0.5, (), ("out",)),
        "mma_sync_fp4_emulated": (["seg_bounds", "vkey_start", "qblocks"], [], 0.5, (), ("out",)),
        "mma_sync_fp8": (list(FakePlan.args), [], 0.5, (), ("out",)),
        # The Hopper FP8 kernel also takes the BF16 q (its q_in_kernel builds quantise it).
        "wgmma_fp8": (list(FakePlan.args), ["item_counter", "cta_begin", "cta_items"], 0.5, (192,),
                      ("out", "q")),
    }
    for op in backends.OPERATORS:
        for b in backends.backends(op):
            if not b.is_kernel or b.name not in expected_tail:
                continue
            tables, counter, scale, tail, lead = expected_tail[b.name]
            operands = tuple(f"view{i}" for i in range(8 if op == "nvfp4" else 7))
            views = operands + tuple(counter)  # the layout's regions (workspace.layout_for)
            module = Recorder()
            launch = b.make_launcher(module, b)
            for _ in range(2):  # the second call reuses the bound arguments
                launch("q", "k", "v", "out", 0.5, (0, 64, 128), plan, views)
            (qname, qargs), (aname, aargs) = module.calls[:2]
            assert module.calls[2:] == module.calls[:2]
            assert qname == f"quantize_{op}"
            assert qargs == ("q", "k", "v", *FakePlan.args, *operands)
            assert aargs == (*lead, *operands[1:], *tables, *counter, scale, *tail), b.name


def test_wgmma_fp16_nvfp4_launcher_runs_one_prepass_and_the_kernel() -> None:
    """The Hopper NVFP4 backend: one pre-pass, quantize_nvfp4_fp16 (the means and the FP16
    operands of its workspace, no codes), then the kernel on qbar and the FP16 regions with the
    used V columns; attention_only is the last call alone, prepass_only the first."""

    b = backends.get("nvfp4", "wgmma_fp16_nvfp4")
    assert b.workspace == "nvfp4_fp16" and b.module == "nvfp4_wgmma" and b.capturable
    names = ("kbar", "qbar", "q_f16", "k_f16", "v_f16", "item_counter")
    module = Recorder()
    launch = b.make_launcher(module, b)
    launch("q", "k", "v", "out", 0.5, (0, 64, 128), FakePlan(), names)
    tables = FakePlan.args
    assert module.calls == [
        ("quantize_nvfp4_fp16", ("q", "k", "v", *tables, *names[:5])),
        ("attention_nvfp4_wgmma", ("out", "qbar", *names[2:5], *tables, "item_counter", 0.5, 192)),
    ]
    module.calls.clear()
    launch.prepass_only("q", "k", "v", "out", 0.5, (0, 64, 128), FakePlan(), names)
    assert [c[0] for c in module.calls] == ["quantize_nvfp4_fp16"]
    module.calls.clear()
    launch.attention_only("q", "k", "v", "out", 0.5, (0, 64, 128), FakePlan(), names)
    assert [c[0] for c in module.calls] == ["attention_nvfp4_wgmma"]
