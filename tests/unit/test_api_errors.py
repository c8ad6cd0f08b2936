"""Argument errors of the public operators (SPEC 2), on the CPU.

Every malformed call must raise ``ValueError`` (``TypeError`` for a wrong Python type) whose
message starts with the name of the offending argument, before anything is launched, leaving
``out`` untouched. The CUDA-device check comes last in the operators, so CPU tensors reach every
other check; mixed devices use ``meta`` tensors. Each case is run twice: through the plain public
API (where the valid baseline fails only on the CUDA check) and with the CUDA check disabled and a
recording fake backend (where the baseline launches and the malformed call launches nothing).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from flashinfer_h3 import backends
from flashinfer_h3 import diffusion_ops as ops
from flashinfer_h3.plan import PLANS

T, H, D = 200, 2, 128
BOUNDS = [0, 64, 64, 200]

OPS = {
    "nvfp4": ops.minimax_h3_sm120_varlen_attention_nvfp4,
    "fp8": ops.minimax_h3_sm120_varlen_attention_fp8,
}


def _args() -> dict[str, Any]:
    """Fresh, valid CPU arguments (random contents, a sentinel-filled out)."""
    q, k, v = (torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    return {
        "q": q, "k": k, "v": v,
        "cu_seqlens": torch.tensor(BOUNDS, dtype=torch.int32),
        "out": torch.full((T, H, D), 7.0, dtype=torch.bfloat16),
        "cu_seqlens_host": list(BOUNDS),
        "softmax_scale": 0.05,
    }


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """Same shape and dtype, not contiguous."""
    return torch.empty((t.shape[1], t.shape[0], *t.shape[2:]), dtype=t.dtype).transpose(0, 1)


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.bfloat16)


@dataclass(frozen=True)
class Case:
    id: str
    change: Callable[[dict[str, Any]], None]  # mutates the valid arguments
    exc: type[Exception]
    name: str  # the argument the message must start with


def _set(**kw: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def change(a: dict[str, Any]) -> None:
        for key, make in kw.items():
            a[key] = make(a)
    return change


CASES = [
    # q, k, v: type, dtype, rank, head dim, heads, shape mismatch, contiguity, device
    Case("q_not_tensor", _set(q=lambda a: a["q"].tolist()), TypeError, "q"),
    Case("q_float16", _set(q=lambda a: a["q"].half()), ValueError, "q"),
    Case("k_float32", _set(k=lambda a: a["k"].float()), ValueError, "k"),
    Case("v_int8", _set(v=lambda a: a["v"].to(torch.int8)), ValueError, "v"),
    Case("q_2d", _set(q=lambda a: a["q"].reshape(T, H * D)), ValueError, "q"),
    Case("k_4d", _set(k=lambda a: a["k"].reshape(T, H, 2, D // 2)), ValueError, "k"),
    Case("v_1d", _set(v=lambda a: a["v"].flatten()), ValueError, "v"),
    Case("q_head_dim_64", _set(q=lambda a: _bf16(T, 2 * H, 64)), ValueError, "q"),
    Case("k_head_dim_64", _set(k=lambda a: _bf16(T, 2 * H, 64)), ValueError, "k"),
    Case("v_head_dim_256", _set(v=lambda a: _bf16(T, 1, 256)), ValueError, "v"),
    Case("zero_heads", _set(q=lambda a: _bf16(T, 0, D), k=lambda a: _bf16(T, 0, D),
                            v=lambda a: _bf16(T, 0, D), out=lambda a: _bf16(T, 0, D)),
         ValueError, "q"),
    Case("k_fewer_tokens", _set(k=lambda a: a["k"][:-1].clone()), ValueError, "k"),
    Case("v_more_heads", _set(v=lambda a: _bf16(T, H + 1, D)), ValueError, "v"),
    Case("q_not_contiguous", _set(q=lambda a: _strided(a["q"])), ValueError, "q"),
    Case("k_not_contiguous", _set(k=lambda a: _strided(a["k"])), ValueError, "k"),
    Case("v_not_contiguous", _set(v=lambda a: _strided(a["v"])), ValueError, "v"),
    Case("q_other_device_than_k", _set(q=lambda a: _meta(a["q"])), ValueError, "k"),
    Case("k_other_device", _set(k=lambda a: _meta(a["k"])), ValueError, "k"),
    Case("v_other_device", _set(v=lambda a: _meta(a["v"])), ValueError, "v"),
    # cu_seqlens: type, dtype, rank, length, values, device
    Case("cu_not_tensor", _set(cu_seqlens=lambda a: list(BOUNDS)), TypeError, "cu_seqlens"),
    Case("cu_int64", _set(cu_seqlens=lambda a: a["cu_seqlens"].long()), ValueError,
         "cu_seqlens"),
    Case("cu_2d", _set(cu_seqlens=lambda a: a["cu_seqlens"].view(2, 2)), ValueError,
         "cu_seqlens"),
    Case("cu_empty", _set(cu_seqlens=lambda a: torch.zeros(0, dtype=torch.int32),
                          cu_seqlens_host=lambda a: None), ValueError, "cu_seqlens"),
    Case("cu_first_not_zero",
         _set(cu_seqlens=lambda a: torch.tensor([3, 64, 64, T], dtype=torch.int32),
              cu_seqlens_host=lambda a: None), ValueError, "cu_seqlens"),
    Case("cu_decreasing",
         _set(cu_seqlens=lambda a: torch.tensor([0, 100, 64, T], dtype=torch.int32),
              cu_seqlens_host=lambda a: None), ValueError, "cu_seqlens"),
    Case("cu_last_not_tokens",
         _set(cu_seqlens=lambda a: torch.tensor([0, 64, 64, T - 1], dtype=torch.int32),
              cu_seqlens_host=lambda a: None), ValueError, "cu_seqlens"),
    Case("cu_last_beyond_tokens",
         _set(cu_seqlens=lambda a: torch.tensor([0, 64, 64, T + 5], dtype=torch.int32),
              cu_seqlens_host=lambda a: None), ValueError, "cu_seqlens"),
    Case("cu_other_device", _set(cu_seqlens=lambda a: _meta(a["cu_seqlens"])), ValueError,
         "cu_seqlens"),
    # cu_seqlens_host: type, length, values
    Case("host_wrong_type", _set(cu_seqlens_host=lambda a: 200), TypeError, "cu_seqlens_host"),
    Case("host_string", _set(cu_seqlens_host=lambda a: "0,64,64,200"), TypeError,
         "cu_seqlens_host"),
    Case("host_float_entry", _set(cu_seqlens_host=lambda a: [0, 64.0, 64, T]), TypeError,
         "cu_seqlens_host"),
    Case("host_float_tensor",
         _set(cu_seqlens_host=lambda a: torch.tensor(BOUNDS, dtype=torch.float32)), TypeError,
         "cu_seqlens_host"),
    Case("host_too_short", _set(cu_seqlens_host=lambda a: [0, 64, T]), ValueError,
         "cu_seqlens_host"),
    Case("host_too_long", _set(cu_seqlens_host=lambda a: [0, 64, 64, 100, T]), ValueError,
         "cu_seqlens_host"),
    Case("host_first_not_zero", _set(cu_seqlens_host=lambda a: [1, 64, 64, T]), ValueError,
         "cu_seqlens_host"),
    Case("host_decreasing", _set(cu_seqlens_host=lambda a: [0, 64, 63, T]), ValueError,
         "cu_seqlens_host"),
    Case("host_last_not_tokens", _set(cu_seqlens_host=lambda a: [0, 64, 64, T + 1]), ValueError,
         "cu_seqlens_host"),
    # out: type, dtype, shape, contiguity, device, aliasing an input
    Case("out_not_tensor", _set(out=lambda a: 3.0), TypeError, "out"),
    Case("out_float32", _set(out=lambda a: torch.full((T, H, D), 7.0)), ValueError, "out"),
    Case("out_wrong_shape", _set(out=lambda a: torch.full((T, H + 1, D), 7.0,
                                                          dtype=torch.bfloat16)),
         ValueError, "out"),
    Case("out_not_contiguous", _set(out=lambda a: _strided(a["out"]).fill_(7.0)), ValueError,
         "out"),
    Case("out_other_device", _set(out=lambda a: _meta(a["out"])), ValueError, "out"),
    Case("out_is_q", _set(out=lambda a: a["q"]), ValueError, "out"),
    Case("out_overlaps_v", lambda a: _overlap_v_and_out(a), ValueError, "out"),
    # softmax_scale: value and type
    Case("scale_zero", _set(softmax_scale=lambda a: 0.0), ValueError, "softmax_scale"),
    Case("scale_negative", _set(softmax_scale=lambda a: -0.1), ValueError, "softmax_scale"),
    Case("scale_nan", _set(softmax_scale=lambda a: math.nan), ValueError, "softmax_scale"),
    Case("scale_inf", _set(softmax_scale=lambda a: math.inf), ValueError, "softmax_scale"),
    Case("scale_string", _set(softmax_scale=lambda a: "0.1"), TypeError, "softmax_scale"),
    Case("scale_bool", _set(softmax_scale=lambda a: True), TypeError, "softmax_scale"),
    Case("scale_tensor", _set(softmax_scale=lambda a: torch.tensor(0.1)), TypeError,
         "softmax_scale"),
]


def _overlap_v_and_out(a: dict[str, Any]) -> None:
    """v and out: contiguous [T, H, 128] views of one buffer, out starting halfway into v."""
    n = T * H * D
    big = torch.randn(2 * n, dtype=torch.bfloat16)
    a["v"] = big[:n].view(T, H, D)
    a["out"] = big[n // 2 : n // 2 + n].view(T, H, D)


@pytest.fixture(autouse=True)
def _fresh_plans():
    PLANS.clear()
    yield
    PLANS.clear()


def _call(op: str, a: dict[str, Any]) -> torch.Tensor:
    return OPS[op](a["q"], a["k"], a["v"], a["cu_seqlens"], a["out"],
                   cu_seqlens_host=a["cu_seqlens_host"], softmax_scale=a["softmax_scale"])


def _snapshot(out: Any) -> Any:
    if isinstance(out, torch.Tensor) and out.device.type != "meta":
        return out.clone()
    return out


def _assert_untouched(before: Any, after: Any) -> None:
    if isinstance(before, torch.Tensor) and before.device.type != "meta":
        assert torch.equal(before, after), "out was modified by a failing call"


def _assert_raises(case: Case, op: str, a: dict[str, Any]) -> None:
    out = a["out"]
    before = _snapshot(out)
    with pytest.raises(case.exc) as info:
        _call(op, a)
    msg = str(info.value)
    assert re.match(rf"{re.escape(case.name)}\b", msg), (
        f"message does not start with the argument {case.name!r}: {msg!r}"
    )
    _assert_untouched(before, out)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_call_public_api(op: str, case: Case) -> None:
    a = _args()
    case.change(a)
    _assert_raises(case, op, a)


@pytest.mark.parametrize("op", sorted(OPS))
def test_valid_cpu_call_fails_only_on_device(op: str) -> None:
    """The baseline of the table is valid except for living on the CPU."""
    a = _args()
    before = a["out"].clone()
    with pytest.raises(ValueError, match=r"^q, k, v, cu_seqlens \(and out\) must be CUDA"):
        _call(op, a)
    assert torch.equal(before, a["out"])


class _Recorder:
    """A fake kernel backend: records launches and writes a recognisable value into out."""

    def __init__(self) -> None:
        self.launches = 0

    def run(self, q, k, v, out, scale, bounds, plan, views) -> None:
        self.launches += 1
        out.fill_(1.5)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    fake = backends.Backend("recorder", "nvfp4", backends.KERNEL, lambda module, b: rec.run,
                            module="nvfp4", workspace="nvfp4", capturable=True, archs=("sm_90a",))
    backend = backends.Prepared(fake, rec.run)
    monkeypatch.setattr(ops, "check_cuda", lambda q: None)
    monkeypatch.setattr(ops, "_backend", lambda op, device: backend)
    return rec


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_call_launches_nothing(op: str, case: Case, recorder: _Recorder) -> None:
    # The baseline runs and launches once; the malformed call raises and launches nothing.
    good = _args()
    assert _call(op, good) is good["out"]
    assert recorder.launches == 1 and bool((good["out"] == 1.5).all())
    a = _args()
    case.change(a)
    _assert_raises(case, op, a)
    assert recorder.launches == 1


def test_cached_plan_still_checks_last_entry(recorder: _Recorder) -> None:
    """A plan-cache hit skips re-validating the bounds, but not the per-call facts."""
    a = _args()
    _call("nvfp4", a)
    assert len(PLANS) == 1
    b = _args()
    b["q"], b["k"], b["v"] = (_bf16(T + 8, H, D) for _ in range(3))
    b["out"] = torch.full((T + 8, H, D), 7.0, dtype=torch.bfloat16)
    before = b["out"].clone()
    with pytest.raises(ValueError, match=r"^cu_seqlens_host\[-1\] must equal tokens"):
        _call("nvfp4", b)
    assert torch.equal(before, b["out"]) and recorder.launches == 1
    c = _args()
    c["cu_seqlens_host"] = [0, 64, 64]  # wrong length is checked before the cache
    with pytest.raises(ValueError, match=r"^cu_seqlens_host has 3 entries, expected 4"):
        _call("nvfp4", c)


def test_host_bounds_accept_tuple_tensor_and_numpy(recorder: _Recorder) -> None:
    np = pytest.importorskip("numpy")
    for host in (tuple(BOUNDS), torch.tensor(BOUNDS), np.array(BOUNDS, dtype=np.int64)):
        a = _args()
        a["cu_seqlens_host"] = host
        assert _call("nvfp4", a) is a["out"]
    assert recorder.launches == 3
    assert len(PLANS) == 1  # one plan for the three spellings of the same bounds
    ((bounds, _, _),) = [key for key in PLANS._plans]
    assert all(type(b) is int for b in bounds)


def test_default_scale_and_int_scale_accepted() -> None:
    assert ops.check_softmax_scale(None) == 1 / math.sqrt(128)
    assert ops.check_softmax_scale(2) == 2.0
    np = pytest.importorskip("numpy")
    assert ops.check_softmax_scale(np.float32(0.25)) == 0.25


def test_zero_tokens_is_valid(recorder: _Recorder) -> None:
    for bounds in ([0], [0, 0, 0]):
        a = _args()
        a["q"], a["k"], a["v"] = (torch.empty(0, H, D, dtype=torch.bfloat16) for _ in range(3))
        a["out"] = None
        a["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
        a["cu_seqlens_host"] = None
        res = _call("nvfp4", a)
        assert res.shape == (0, H, D) and res.dtype == torch.bfloat16
    assert recorder.launches == 0


@pytest.mark.parametrize("choice,cap,expected", [
    ("auto", (9, 0), "wgmma_fp16_nvfp4"), ("auto", (12, 0), "mma_sync_fp4"),
    ("auto", (12, 1), "mma_sync_fp4"),
    ("mma_sync_fp4_emulated", (9, 0), "mma_sync_fp4_emulated"),
    ("mma_sync_fp4", (12, 0), "mma_sync_fp4"),
    ("sm120_emulated", (9, 0), "mma_sync_fp4_emulated"), ("sm120", (12, 0), "mma_sync_fp4"),
    ("reference", (9, 0), "reference"), ("reference", (8, 0), "reference"),
    (" Auto ", (9, 0), "wgmma_fp16_nvfp4"),
])
def test_backend_resolution(choice: str, cap: tuple[int, int], expected: str) -> None:
    assert ops.resolve_backend_name("nvfp4", cap, choice) == expected


@pytest.mark.parametrize("cap", [(9, 0), (12, 0), (12, 1)])
def test_fp8_resolves_to_the_torch_emulation_until_a_kernel_is_registered(
        cap: tuple[int, int]) -> None:
    kernels = [b for b in backends.backends("fp8") if b.is_kernel]
    backend = backends.resolve("fp8", cap, "auto")
    if kernels:
        pytest.skip(f"an FP8 kernel backend is registered: {[b.name for b in kernels]}")
    assert backend.name == "reference" and backend.kind == "reference"
    assert backend.label == "reference (torch emulation)"


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (10, 0), (7, 5)])
def test_unsupported_gpu_names_capabilities(op: str, cap: tuple[int, int]) -> None:
    with pytest.raises(RuntimeError) as info:
        ops.resolve_backend_name(op, cap, "auto")
    msg = str(info.value)
    assert f"{cap[0]}.{cap[1]}" in msg and "9.0" in msg and "12.0" in msg, msg


def test_backend_choice_errors() -> None:
    with pytest.raises(ValueError, match=f"^{ops.ENV_NVFP4_BACKEND}='fast' is not a backend"):
        ops.resolve_backend_name("nvfp4", (9, 0), "fast")
    with pytest.raises(ValueError, match=f"^{ops.ENV_FP8_BACKEND}='mma_sync_fp4' is not"):
        ops.resolve_backend_name("fp8", (9, 0), "mma_sync_fp4")
    with pytest.raises(RuntimeError, match=r"=mma_sync_fp4 needs compute capability 12\.x, but "
                       r"this GPU is 9\.0; the nvfp4 backends that run here: "
                       r"mma_sync_fp4_emulated, wgmma_fp16_nvfp4, reference, auto"):
        ops.resolve_backend_name("nvfp4", (9, 0), "mma_sync_fp4")
    # The old names are aliases; messages give the new name.
    with pytest.raises(RuntimeError, match=r"sm120 \(now named mma_sync_fp4\) needs compute "
                       r"capability 12\.x.*9\.0"):
        ops.resolve_backend_name("nvfp4", (9, 0), "sm120")
    with pytest.raises(RuntimeError, match=r"sm120_emulated \(now named mma_sync_fp4_emulated\) "
                       r"needs compute capability 9\.0.*12\.0.*mma_sync_fp4, reference"):
        ops.resolve_backend_name("nvfp4", (12, 0), "sm120_emulated")
