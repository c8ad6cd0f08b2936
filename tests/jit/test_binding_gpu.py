"""The tvm-ffi binding on a real GPU, through the first real module (utils.fill_u8):
JIT build + load for the present arch, torch's current stream (default and non-default),
CUDA-graph capture and replay, and C++ check failures as Python exceptions."""

from __future__ import annotations

import pytest
import torch

from flashinfer_h3.jit import detect_arch, get_module

pytestmark = pytest.mark.gpu

POISON = 0xA5


@pytest.fixture(scope="module")
def utils():
    mod = get_module("utils")
    # Warm the kernel up: CUDA's lazy loading may synchronise on a kernel's first launch,
    # which would hide a stream-ordering bug in the tests below.
    warm = torch.empty(64, dtype=torch.uint8, device="cuda")
    mod.fill_u8(warm, 1)
    torch.cuda.synchronize()
    return mod


def test_module_is_built_for_this_gpu(utils) -> None:
    arch = detect_arch(torch.device("cuda"))
    major, minor = torch.cuda.get_device_capability()
    assert arch == {(9, 0): "sm_90a", (12, 0): "sm_120a", (12, 1): "sm_121a"}[(major, minor)]
    assert f"arch={arch}" in utils.build_info()
    assert get_module("utils") is utils


@pytest.mark.parametrize("offset", [0, 1, 7, 15])
@pytest.mark.parametrize("nbytes", [1, 15, 16, 17, 255, 4096 + 3, (1 << 22) + 5])
def test_fill_writes_exactly_the_tensor_bytes(utils, nbytes: int, offset: int) -> None:
    # A view into a larger buffer: an unaligned start, and guard bytes on both sides that must
    # stay untouched.
    buf = torch.zeros(nbytes + 64, dtype=torch.uint8, device="cuda")
    view = buf[32 + offset : 32 + offset + nbytes]
    utils.fill_u8(view, POISON)
    torch.cuda.synchronize()
    assert bool((view == POISON).all())
    assert int(buf[: 32 + offset].count_nonzero()) == 0
    assert int(buf[32 + offset + nbytes :].count_nonzero()) == 0


def test_fill_any_dtype_and_empty(utils) -> None:
    out = torch.zeros(3, 5, 128, dtype=torch.bfloat16, device="cuda")
    utils.fill_u8(out, 0xFF)  # poisoning an output: 0xFFFF is a bf16 NaN
    f32 = torch.zeros(1000, dtype=torch.float32, device="cuda")
    utils.fill_u8(f32, 0x3F)
    empty = torch.empty(0, 128, dtype=torch.bfloat16, device="cuda")
    utils.fill_u8(empty, 0xFF)
    torch.cuda.synchronize()
    assert bool(out.isnan().all())
    assert bool((f32.view(torch.int32) == 0x3F3F3F3F).all())


def test_runs_on_the_current_non_default_stream(utils) -> None:
    x = torch.zeros(1 << 24, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Keep the side stream busy, then queue a torch write and ours behind it. If fill_u8
        # ignored the current stream it would run first and the torch write would win.
        torch.cuda._sleep(200_000_000)  # ~0.1 s
        x.fill_(1)
        utils.fill_u8(x, 7)
        done = torch.cuda.Event()
        done.record(side)
    assert not done.query(), "the side stream finished too early for the test to mean anything"
    done.synchronize()
    assert bool((x == 7).all())
    # And back on the default stream.
    utils.fill_u8(x, 9)
    torch.cuda.synchronize()
    assert bool((x == 9).all())


def test_cuda_graph_capture_and_replay(utils) -> None:
    a = torch.zeros(4096 + 7, dtype=torch.uint8, device="cuda")
    b = torch.zeros(2, 3, 128, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch recommends
        utils.fill_u8(a, 1)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        utils.fill_u8(a, 0x5A)
        utils.fill_u8(b, 0xFF)
    torch.cuda.synchronize()
    # Captured, not executed: the launches went to the capture stream.
    assert bool((a == 1).all()) and int(b.count_nonzero()) == 0

    for round_ in range(3):
        a.fill_(round_)
        b.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert bool((a == 0x5A).all()), round_
        assert bool(b.isnan().all()), round_


def test_cpp_checks_become_python_exceptions(utils) -> None:
    x = torch.zeros(64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"fill_u8: value must be a byte in \[0, 255\], got 256"):
        utils.fill_u8(x, 256)
    with pytest.raises(ValueError, match="value must be a byte"):
        utils.fill_u8(x, -1)
    with pytest.raises(ValueError, match="t must be a CUDA tensor"):
        utils.fill_u8(torch.zeros(4, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="t must be contiguous"):
        utils.fill_u8(x.view(8, 8).t(), 1)
    with pytest.raises(TypeError):
        utils.fill_u8(x, "1")
    torch.cuda.synchronize()
    assert int(x.count_nonzero()) == 0  # nothing ran
    utils.fill_u8(x, 3)  # the module still works
    torch.cuda.synchronize()
    assert bool((x == 3).all())


def test_unsupported_gpu_message(monkeypatch) -> None:
    from flashinfer_h3.jit import UnsupportedArchError, arch_for_capability

    with pytest.raises(UnsupportedArchError) as info:
        arch_for_capability(8, 0)
    msg = str(info.value)
    assert "compute capability 8.0" in msg and "9.0" in msg and "12.0" in msg
    assert isinstance(info.value, RuntimeError)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (10, 0))
    monkeypatch.delenv("FLASHINFER_H3_CUDA_ARCH_LIST", raising=False)
    with pytest.raises(RuntimeError, match="compute capability 10.0"):
        detect_arch(torch.device("cuda"))
