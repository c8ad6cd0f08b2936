"""Helpers of ``python -m flashinfer_h3 bench``: the sampled FP32 oracle of the accuracy column,
the kernel-only measurement of our kernel backends, the optional peers, and the PNG plot. No GPU
needed to import; torch is imported lazily."""

from __future__ import annotations

import importlib.util
import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

HEAD_DIM = 128
ROWS_PER_SEGMENT = 64
BENCH_EXTRA_HINT = "pip install 'flashinfer-h3[bench]'"


# ---------------------------------------------------------------------------------------------
# accuracy: relative L2 against the FP32 oracle on sampled rows
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampledOracle:
    """Exact FP32 attention of some query rows: ``rows`` (int64 token indices) and ``out``
    (``[len(rows), heads, 128]`` FP32)."""

    rows: Any
    out: Any

    def rel_l2(self, packed_out: Any) -> float:
        """Relative L2 error of ``packed_out[rows]`` (``[tokens, heads, 128]``) vs the oracle."""
        got = packed_out.index_select(0, self.rows.to(packed_out.device)).double()
        ref = self.out.to(got.device).double()
        if not bool(got.isfinite().all()):
            return math.inf
        return float((got - ref).norm() / ref.norm().clamp_min(1e-30))


def sampled_oracle(q: Any, k: Any, v: Any, bounds: Sequence[int], *, seed: int = 0,
                   rows_per_segment: int = ROWS_PER_SEGMENT,
                   softmax_scale: float | None = None) -> SampledOracle:
    """The exact attention (FP32 inputs, FP32 softmax) of up to ``rows_per_segment`` random
    query rows of every segment, on the inputs' device. Cost: ``rows * segment length`` per row
    sampled, so a full-size preset takes milliseconds on a GPU."""
    import torch

    scale = softmax_scale if softmax_scale is not None else HEAD_DIM**-0.5
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows, outs = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        length = b - a
        if length <= 0:
            continue
        take = min(rows_per_segment, length)
        idx = a + torch.randperm(length, generator=gen)[:take].sort().values
        ks, vs = k[a:b].float(), v[a:b].float()  # [L, H, D]
        for chunk in idx.split(16):
            qs = q.index_select(0, chunk.to(q.device)).float()  # [r, H, D]
            scores = torch.einsum("rhd,lhd->hrl", qs, ks) * scale
            probs = torch.softmax(scores, dim=-1)
            outs.append(torch.einsum("hrl,lhd->rhd", probs, vs))
        rows.append(idx)
    if not rows:
        empty = torch.empty(0, dtype=torch.int64)
        return SampledOracle(empty, torch.empty(0, q.shape[1], HEAD_DIM))
    return SampledOracle(torch.cat(rows), torch.cat(outs))


# ---------------------------------------------------------------------------------------------
# kernel only: the attention kernel of our kernel backends alone, pre-pass excluded
# ---------------------------------------------------------------------------------------------

#: The ``scope`` of our rows in the JSON: the whole call (pre-pass, attention kernel, host work)
#: or the attention kernel alone.
WHOLE_CALL, KERNEL_ONLY = "whole call", "kernel only"


def kernel_only_label(op: str, backend: str) -> str:
    """``flashinfer_h3 fp8 [wgmma_fp8] kernel only (no pre-pass)``: the row of the attention
    kernel alone, next to the whole call's ``flashinfer_h3 fp8 [wgmma_fp8 (kernel)]``."""
    return f"flashinfer_h3 {op} [{backend}] {KERNEL_ONLY} (no pre-pass)"


def kernel_only_backend(op: str, device: Any) -> Any | None:
    """The prepared backend (:class:`flashinfer_h3.backends.Prepared`) that a call of ``op`` on
    ``device`` runs, when it can time its attention kernel alone (a kernel backend: its launch
    has ``attention_only`` and it has a workspace); None for the reference and where no backend
    runs (the whole call's row reports why)."""
    from . import diffusion_ops

    try:
        prepared = diffusion_ops._backend(op, device)  # what the operator's call uses
    except (ValueError, RuntimeError):
        return None
    if prepared.workspace is None or getattr(prepared.launch, "attention_only", None) is None:
        return None
    return prepared


@dataclass(eq=False)
class KernelOnly:
    """The attention kernel of a kernel backend alone, on one input.

    :meth:`prime` resolves the plan and the workspace views exactly as the operator's eager
    call does (diffusion_ops._varlen_attention) and runs that whole call once (``launch``: the
    pre-pass writes this input's operands into the views, then the attention kernel); it keeps
    the whole call's output and fills ``out`` with NaN. :meth:`run` then runs only
    ``launch.attention_only`` with the same plan and views, which reads the operands the
    pre-pass left there and writes ``out``: the accuracy column is computed from its output,
    and :meth:`matches_whole_call` says whether it equals the whole call's. Nothing else may
    use the workspace between :meth:`prime` and the last :meth:`run` (the bench primes right
    before this row's calls)."""

    op: str
    prepared: Any  # backends.Prepared
    q: Any
    k: Any
    v: Any
    out: Any
    bounds: tuple[int, ...]
    scale: float
    plan: Any = None
    views: tuple[Any, ...] = ()
    whole_call: Any = None  # the output of prime()'s whole call

    @property
    def backend(self) -> str:
        return str(self.prepared.name)

    @property
    def label(self) -> str:
        return kernel_only_label(self.op, self.backend)

    def prime(self) -> None:
        import torch

        from .diffusion_ops import _stream_state
        from .plan import PLANS
        from .workspace import eager_views, layout_for

        q = self.q
        device = q.device
        tokens, heads = q.shape[0], q.shape[1]
        stream, _ = _stream_state(device)
        self.plan = PLANS.get(self.bounds, heads, device)
        self.plan.ready(stream)
        layout = layout_for(self.prepared.workspace, tokens, heads, len(self.bounds) - 1)
        self.views = eager_views(layout, device, stream)
        self.prepared.launch(q, self.k, self.v, self.out, self.scale, self.bounds, self.plan,
                             self.views)
        self.whole_call = self.out.clone()
        self.out.fill_(torch.nan)  # what the accuracy column reads comes from run() alone

    def run(self) -> Any:
        if self.plan is None:
            raise RuntimeError("KernelOnly.run before prime: the workspace holds no operands")
        self.prepared.launch.attention_only(self.q, self.k, self.v, self.out, self.scale,
                                            self.bounds, self.plan, self.views)
        return self.out

    def matches_whole_call(self, result: Any) -> bool:
        """Whether ``result`` (an output of :meth:`run`) equals the primed whole call's output,
        bit for bit; then forgets that copy."""
        import torch

        same = self.whole_call is not None and bool(torch.equal(result, self.whole_call))
        self.whole_call = None
        return same


def kernel_only_peer(op: str, q: Any, k: Any, v: Any, bounds: Sequence[int], out: Any,
                     softmax_scale: float | None = None) -> KernelOnly | None:
    """The kernel-only measurement of ``op`` on these inputs (``out``: its output buffer, may be
    shared with rows run before or after it), or None where the backend of ``op`` on ``q``'s
    device has no kernel to time alone (the reference) or the input is empty."""
    from .diffusion_ops import check_softmax_scale

    prepared = kernel_only_backend(op, q.device)
    if prepared is None or q.shape[0] == 0:
        return None
    return KernelOnly(op, prepared, q, k, v, out, tuple(int(b) for b in bounds),
                      check_softmax_scale(softmax_scale))


# The Hopper module and backend of each operator's benchmark builds (KernelConfig flags).
HOPPER_MODULES = {"nvfp4": ("nvfp4_wgmma", "wgmma_fp16_nvfp4"), "fp8": ("fp8_wgmma", "wgmma_fp8")}


def kernel_only_build(op: str, flags: dict[str, Any], q: Any, k: Any, v: Any, bounds: Sequence[int],
                      out: Any) -> KernelOnly:
    """The kernel-only measurement of a benchmark build of ``op``'s Hopper module (its own
    pre-pass and kernel, through the production backend's launcher), built into the JIT cache
    first if needed."""
    from . import backends
    from .jit import KernelConfig, build_module
    from .jit.load import load_so

    module_name, backend_name = HOPPER_MODULES[op]
    module = load_so(build_module(KernelConfig(module_name, arch="sm_90a", flags=flags)))
    backend = backends.get(op, backend_name)
    prepared = backends.Prepared(backend, backend.make_launcher(module, backend), q.device)
    return KernelOnly(op, prepared, q, k, v, out, tuple(int(b) for b in bounds), HEAD_DIM**-0.5)


def parse_build_flags(spec: str, op: str | None = None) -> dict[str, int]:
    """``FLAG=INTEGER,...`` (a benchmark build's KernelConfig flags) as a dict; with ``op``, also
    checked against the flags ``op``'s Hopper module takes (jit/modules.py: a misspelt or removed
    flag would build production). Raises ValueError naming what was wrong."""
    import re

    flags: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or not key.isidentifier() or re.fullmatch(r"-?[0-9]+", value) is None:
            raise ValueError(f"expected FLAG=INTEGER, got {part!r}")
        if key in flags:
            raise ValueError(f"flag {key!r} given twice in {spec!r}")
        flags[key] = int(value)
    if op is not None:
        if op not in HOPPER_MODULES:
            raise ValueError(f"no Hopper module for op {op!r}; expected one of "
                             f"{', '.join(HOPPER_MODULES)}")
        from .jit import KernelConfig
        from .jit.spec import module_flags

        # KernelConfig refuses a flag the module does not take; module_flags checks the level.
        module_flags(KernelConfig(HOPPER_MODULES[op][0], arch="sm_90a", flags=flags))
    return flags


# ---------------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[tuple[int, ...], int]:
    """A benchmark shape ``LENGTHS:HEADS``, lengths comma-separated, each ``LENGTH`` or
    ``LENGTH*COUNT`` (e.g. ``30720*2,333:56``: two 30,720-token segments and one of 333, 56
    heads) -> (segment lengths, heads). Raises ValueError naming the text otherwise."""
    try:
        lengths_text, heads_text = text.split(":")
        lengths: list[int] = []
        for part in lengths_text.split(","):
            length, _, count_text = part.partition("*")
            count = int(count_text or 1)
            if count < 1:
                raise ValueError(part)
            lengths += [int(length)] * count
        heads = int(heads_text)
    except ValueError:
        raise ValueError(f"expected LENGTHS:HEADS such as 30720*4:56, got {text!r}") from None
    if not lengths or min(lengths) < 0 or sum(lengths) < 1 or heads < 1:
        raise ValueError(f"expected lengths >= 0 (one token at least) and heads >= 1 in "
                         f"LENGTHS:HEADS, got {text!r}")
    return tuple(lengths), heads


def bench_shapes(presets: str | None, shapes: Sequence[str], known: Mapping[str, Any]
                 ) -> list[tuple[str, tuple[int, ...], int]]:
    """The benchmark scripts' ``--preset a,b`` (names in ``known``: ``python -m flashinfer_h3
    bench``'s PRESETS, objects with ``lengths`` and ``heads``) and repeated ``--shape
    LENGTHS:HEADS`` (parse_shape) as (name, segment lengths, heads), in that order. Raises
    ValueError starting with the option at fault."""
    out: list[tuple[str, tuple[int, ...], int]] = []
    for name in filter(None, (n.strip() for n in (presets or "").split(","))):
        if name not in known:
            raise ValueError(f"--preset: unknown preset {name!r}; expected one of "
                             f"{', '.join(known)}")
        out.append((name, tuple(known[name].lengths), int(known[name].heads)))
    for text in shapes:
        try:
            out.append((text, *parse_shape(text)))
        except ValueError as e:
            raise ValueError(f"--shape: {e}") from None
    return out


def segments(bounds: Sequence[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=False) if b > a]


def scatter_segments(outputs: Sequence[Any], bounds: Sequence[int], like: Any,
                     layout: str) -> Any:
    """Per-segment outputs (``[1, H, L, D]`` for ``"HND"``, ``[1, L, H, D]`` for ``"NHD"``) ->
    one packed ``[tokens, H, D]`` tensor (for the accuracy column; not timed)."""
    import torch

    packed = torch.zeros_like(like)
    for (a, b), o in zip(segments(bounds), outputs, strict=True):
        packed[a:b] = o[0].transpose(0, 1) if layout == "HND" else o[0]
    return packed


def sdpa_peer(q: Any, k: Any, v: Any, bounds: Sequence[int], backend: Any
              ) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """PyTorch BF16 SDPA with one backend, one call per segment on ``[1, H, L, 128]`` views:
    ``(run, to_packed)``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    views = [tuple(t[a:b].unsqueeze(0).transpose(1, 2) for t in (q, k, v))
             for a, b in segments(bounds)]

    def run() -> list[Any]:
        with sdpa_kernel([backend]), torch.no_grad():
            return [F.scaled_dot_product_attention(qq, kk, vv) for qq, kk, vv in views]

    return run, lambda outs: scatter_segments(outs, bounds, q, "HND")


def sageattention_available() -> bool:
    return importlib.util.find_spec("sageattention") is not None


def sageattention_peer(q: Any, k: Any, v: Any, bounds: Sequence[int]
                       ) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """SageAttention's ``sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=...)``
    (the 1.x and 2.x signature; the installed release picks its kernel for the GPU), one call per
    segment on ``[1, L, H, 128]`` (NHD) views.

    SageAttention smooths K in place (``smooth_k=True``, its default: ``k -= k.mean(seq)``), so it
    gets its own copy of ``k``, made once here and not timed: the other implementations keep
    reading the untouched inputs. Subtracting a key mean changes no softmax row (every score of
    a query row moves by the same amount), so the accuracy column still compares with the oracle
    of the original inputs."""
    from sageattention import sageattn

    k = k.clone()
    views = [tuple(t[a:b].unsqueeze(0) for t in (q, k, v)) for a, b in segments(bounds)]
    scale = HEAD_DIM**-0.5  # the oracle's and the operators' default

    def run() -> list[Any]:
        return [sageattn(qq, kk, vv, tensor_layout="NHD", is_causal=False, sm_scale=scale)
                for qq, kk, vv in views]

    return run, lambda outs: scatter_segments(outs, bounds, q, "NHD")


def cudnn_frontend_available() -> bool:
    return importlib.util.find_spec("cudnn") is not None


def cudnn_fp8_peer(q: Any, k: Any, v: Any, bounds: Sequence[int]
                   ) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    """cuDNN's FP8 attention through cudnn-frontend (``sdpa_fp8``): E4M3 Q/K/V with per-tensor
    descales (amax / 448), FP8 output, one graph per distinct segment length, one execution per
    segment on ``[1, H, L, 128]`` views of the packed tokens. The timed call is the kernel alone
    (the E4M3 casts happen once, here); its output is E4M3, read back as bf16 for the accuracy
    column. For the kernel-only comparison that docs/spec.md section 6 names as the FP8 goal."""
    import cudnn
    import torch

    fp8 = torch.float8_e4m3fn
    T, H, D = q.shape
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

    def scalar(x: float) -> Any:
        return torch.full((1, 1, 1, 1), x, dtype=torch.float32, device=q.device)

    def cast(x: Any) -> tuple[Any, Any]:
        amax = x.float().abs().amax().clamp_min(1e-12)
        return (x.float() * (448.0 / amax)).to(fp8), scalar(float(amax) / 448.0)

    (qf, dq), (kf, dk), (vf, dv) = cast(q), cast(k), cast(v)
    out = torch.empty(T, H, D, dtype=fp8, device=q.device)
    amax_s, amax_o = scalar(0.0), scalar(0.0)
    consts = {"descale_s": scalar(1.0 / 448.0), "scale_s": scalar(448.0), "scale_o": scalar(1.0)}
    graphs: dict[int, Any] = {}

    def build(length: int) -> Any:
        dims, strides = [1, H, length, D], [length * H * D, D, H * D, 1]
        g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        t = {n: g.tensor(name=n, dim=dims, stride=strides, data_type=cudnn.data_type.FP8_E4M3)
             for n in ("q", "k", "v")}
        sc = {n: g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                          data_type=cudnn.data_type.FLOAT)
              for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
        args = dict(q=t["q"], k=t["k"], v=t["v"], attn_scale=D ** -0.5, use_causal_mask=False,
                    **sc)
        try:
            o, _, a_s, a_o = g.sdpa_fp8(**args, generate_stats=False)
        except TypeError:
            o, _, a_s, a_o = g.sdpa_fp8(**args, is_inference=True)
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(
            cudnn.data_type.FP8_E4M3)
        for a in (a_s, a_o):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
                cudnn.data_type.FLOAT)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=q.device)
        return g, t, sc, o, a_s, a_o, ws

    packs = []
    for a, b in segments(bounds):
        if b - a not in graphs:
            graphs[b - a] = build(b - a)
        g, t, sc, o, a_s, a_o, ws = graphs[b - a]
        values = {"descale_q": dq, "descale_k": dk, "descale_v": dv, **consts}
        pack = {t["q"]: qf[a:b], t["k"]: kf[a:b], t["v"]: vf[a:b], o: out[a:b],
                a_s: amax_s, a_o: amax_o, **{sc[n]: values[n] for n in sc}}
        packs.append((g, pack, ws))

    def run() -> Any:
        for g, pack, ws in packs:
            g.execute(pack, ws, handle=handle)
        return out

    return run, lambda result: result.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# the GPU's clock, power and temperature while a measurement runs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuState:
    """Medians of nvidia-smi's samples over one measurement. The H200 runs the low-precision
    kernels at its 700 W board power cap, so the SM clock, and with it the time, depends on the
    power a kernel draws and on how warm the GPU is (leakage): a row's clock is part of its
    time (benchmarks/RESULTS.md)."""

    sm_clock_mhz: float
    power_w: float
    temperature_c: float


def nvidia_smi_device(torch_index: int) -> str:
    """nvidia-smi's ``-i`` for torch's device ``torch_index``: nvidia-smi counts every GPU of the
    machine, torch only those of CUDA_VISIBLE_DEVICES, whose entry (an index or a UUID, both of
    which ``-i`` takes) names the GPU. (With several GPU models, torch's default
    CUDA_DEVICE_ORDER=FASTEST_FIRST may still differ from nvidia-smi's PCI order.)"""
    import os

    entries = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    visible = [d.strip() for d in entries if d.strip()]
    return visible[torch_index] if torch_index < len(visible) else str(torch_index)


class GpuSampler:
    """``with GpuSampler(torch_index) as s: ...`` samples the SM clock, board power and GPU
    temperature every 100 ms through ``nvidia-smi`` meanwhile; ``s.state`` is then their
    medians, or None where nvidia-smi is missing or gave no sample after the first two (which
    see the warm-up start and are dropped)."""

    def __init__(self, torch_index: int, period_ms: int = 100) -> None:
        self.query = [
            "nvidia-smi", "-i", nvidia_smi_device(torch_index),
            "--query-gpu=clocks.sm,power.draw,temperature.gpu",
            "--format=csv,noheader,nounits", "-lms", str(period_ms),
        ]
        self.proc: Any = None
        self.state: GpuState | None = None

    def __enter__(self) -> GpuSampler:
        import shutil
        import subprocess

        if shutil.which(self.query[0]) is not None:
            self.proc = subprocess.Popen(self.query, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        lines = self.proc.communicate()[0].splitlines()
        samples = []
        for line in lines[2:]:
            try:
                mhz, watts, celsius = (float(x) for x in line.split(","))
            except ValueError:  # "[N/A]" or a truncated last line
                continue
            samples.append((mhz, watts, celsius))
        if samples:
            import statistics

            self.state = GpuState(*(statistics.median(col) for col in zip(*samples, strict=True)))


# ---------------------------------------------------------------------------------------------
# energy: joules a call, from the GPU's own counter
# ---------------------------------------------------------------------------------------------


class EnergyMeter:
    """The GPU's total energy counter: NVML's ``nvmlDeviceGetTotalEnergyConsumption``
    (millijoules since the driver loaded; Volta and later), read through ctypes from the
    driver's ``libnvidia-ml.so.1``, so no Python package is needed. ``read()`` gives joules, or
    None where NVML or the counter is missing (no GPU, another vendor's driver). On a MIG slice
    the counter is the whole GPU's.

    Why: at the power cap a kernel's time is what its energy allows (the SM clock follows the
    board power), so joules a call say what a change saves where its time, at another clock,
    does not (benchmarks/RESULTS.md, twenty-fourth session)."""

    def __init__(self, torch_index: int) -> None:
        import ctypes

        self._ctypes = ctypes
        self._lib: Any = None
        self._handle = ctypes.c_void_p()
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        if lib.nvmlInit_v2() != 0:
            return
        if self._find(lib, torch_index):
            self._lib = lib
        else:
            lib.nvmlShutdown()

    def _find(self, lib: Any, torch_index: int) -> bool:
        """NVML's handle of torch's device: by PCI bus id where torch gives it (NVML counts
        every GPU of the machine, torch those of CUDA_VISIBLE_DEVICES), else (or if that fails)
        by nvidia-smi's index or UUID (nvidia_smi_device)."""
        ctypes = self._ctypes
        handle = ctypes.byref(self._handle)
        try:
            import torch

            props = torch.cuda.get_device_properties(torch_index)
            bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            if lib.nvmlDeviceGetHandleByPciBusId_v2(bus_id.encode(), handle) == 0:
                return True
        except (ImportError, AttributeError, RuntimeError, AssertionError):
            pass
        name = nvidia_smi_device(torch_index)
        if name.isdigit():
            return lib.nvmlDeviceGetHandleByIndex_v2(int(name), handle) == 0
        return lib.nvmlDeviceGetHandleByUUID(name.encode(), handle) == 0

    def read(self) -> float | None:
        if self._lib is None:
            return None
        mj = self._ctypes.c_ulonglong()
        if self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, self._ctypes.byref(mj)) != 0:
            return None
        return mj.value / 1000.0

    def close(self) -> None:
        """Releases NVML (nvmlShutdown); ``read()`` gives None afterwards."""
        if self._lib is not None:
            self._lib.nvmlShutdown()
            self._lib = None


class EnergyCounter(Protocol):
    """What energy_per_call reads: joules so far, or None (EnergyMeter, or a test's stand-in)."""

    def read(self) -> float | None: ...


@dataclass(frozen=True)
class EnergyPerCall:
    """One energy window: ``calls`` calls back to back, busy for ``busy_seconds`` (wall clock,
    from the counter update that opens the window to the last call's end), and ``joules`` drawn
    from that update to the next one after the last call. The joules include that idle tail (at
    most one refresh period, ~0.1 s on an H100: under 1 % of a window of seconds at hundreds of
    watts, at idle power); the busy time does not, so ``ms_per_call`` is the calls' own."""

    calls: int
    busy_seconds: float
    joules: float

    @property
    def joules_per_call(self) -> float:
        return self.joules / self.calls

    @property
    def watts(self) -> float:
        """Joules over the busy time: the calls' mean power (high by the idle tail's joules)."""
        return self.joules / self.busy_seconds

    @property
    def ms_per_call(self) -> float:
        return 1e3 * self.busy_seconds / self.calls


def _next_update(read: Callable[[], float | None], clock: Callable[[], float],
                 limit_s: float) -> tuple[float, float] | None:
    """(time, joules) at the counter's next change: NVML refreshes it every ~20-100 ms, so a
    window that opens on a change carries no partial refresh period at its start. None if it
    never changes within ``limit_s`` (or cannot be read)."""
    first = read()
    if first is None:
        return None
    start = clock()
    while clock() - start < limit_s:
        value = read()
        if value is None:
            return None
        if value != first:
            return clock(), value
    return None


def energy_per_call(fn: Callable[[], Any], meter: EnergyCounter, seconds: float,
                    sync: Callable[[], None], clock: Callable[[], float] | None = None,
                    update_limit_s: float = 2.0) -> EnergyPerCall | None:
    """Calls ``fn`` back to back (``sync`` after each, so the busy time ends with the GPU's
    work) for at least ``seconds``, from one update of the energy counter; the joules run to the
    counter's next update after the last call (EnergyPerCall). None without a counter, or if it
    does not update within ``update_limit_s``."""
    import time

    clock = clock or time.perf_counter
    fn()
    sync()
    begin = _next_update(meter.read, clock, update_limit_s)
    if begin is None:
        return None
    calls = 0
    busy_end = begin[0]
    while calls == 0 or busy_end - begin[0] < seconds:
        fn()
        sync()
        calls += 1
        busy_end = clock()
    end = _next_update(meter.read, clock, update_limit_s)
    if end is None:
        return None
    return EnergyPerCall(calls, busy_end - begin[0], end[1] - begin[1])


# ---------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------


def _short(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"bench --plot needs matplotlib: {BENCH_EXTRA_HINT}")


def plot(payload: dict[str, Any], path: str) -> None:
    """Grouped bars, one group per preset and one bar per implementation: TFLOP/s (top) and
    milliseconds (bottom), each bar labelled; failed measurements are left out."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = payload["runs"]
    names: list[str] = []
    for run in runs:
        for r in run["results"]:
            if r.get("ms") is not None and r["name"] not in names:
                names.append(r["name"])
    presets = [run["preset"] for run in runs]
    wide = 1.6 + 0.65 * len(presets) * max(1, len(names))
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, wide), 8.5))
    width = 0.8 / max(1, len(names))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key, unit in ((axes[0], "tflops", "TFLOP/s"), (axes[1], "ms", "ms (median)")):
        for j, name in enumerate(names):
            xs, ys = [], []
            for i, run in enumerate(runs):
                row = next((r for r in run["results"] if r["name"] == name), None)
                if row is not None and row.get(key) is not None:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(row[key])
            bars = ax.bar(xs, ys, width, label=name, color=colors[j % len(colors)])
            ax.bar_label(bars, labels=[_short(y) for y in ys], fontsize=7, padding=1)
        ax.set_xticks(range(len(presets)))
        ax.set_xticklabels([
            f"{run['preset']}\n{sum(run['lengths']):,} tok x {run['heads']} heads"
            for run in runs
        ])
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.12)
    axes[0].legend(fontsize=8, ncol=min(3, max(1, len(names))), loc="upper center",
                   bbox_to_anchor=(0.5, -0.18))
    # The accuracy column under the time panel: relative L2 vs the FP32 oracle per bar.
    # Wrapped to the figure's width (about 18 characters of 6.5 pt text per inch).
    lines: list[str] = []
    chars = max(60, int(fig.get_figwidth() * 18))
    for run in runs:
        cells = [f"{r['name']} {r['rel_l2']:.3f}" for r in run["results"]
                 if r.get("rel_l2") is not None]
        if cells:
            text = f"{run['preset']}: " + ", ".join(cells)
            if not lines:
                text = "relative L2 vs FP32 oracle (sampled rows) - " + text
            lines += textwrap.wrap(text, chars, subsequent_indent="    ")
    if lines:
        fig.text(0.01, 0.005, "\n".join(lines), fontsize=6.5, va="bottom", ha="left")
    versions = payload.get("versions", {})
    title = f"flashinfer_h3 {payload.get('flashinfer_h3')} on {payload.get('device')}"
    sub = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    axes[0].set_title(title + (f"\n{sub}" if sub else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.02 + 0.018 * len(lines), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# markdown (docs/benchmarks.md)
# ---------------------------------------------------------------------------------------------


def rounds_note(rounds: int) -> str:
    """What ``bench --rounds`` did, as a clause after "median of N runs after W warm-up" (empty
    for one round): the bench's header line and the markdown table say it alike."""
    return "" if rounds == 1 else (f", every row timed in {rounds} rounds in turn, each round "
                                   "from another row (their median)")


Timed = tuple[float, float | None, float | None]  # ms, SM clock (MHz), board power (W)


def rounds_summary(measured: Sequence[Timed]) -> tuple[float, float, str]:
    """A row's rounds of the benchmark scripts' timings (bench_wgmma_variants.py
    ``timed_with_clocks``: ms, SM clock, board power): the median ms, the rounds' spread (max - min
    over the median) and ``", SM clock C MHz, P W"`` (medians; empty without samples)."""
    import statistics

    ms = statistics.median(t for t, _, _ in measured)
    spread = (max(t for t, _, _ in measured) - min(t for t, _, _ in measured)) / ms
    clocks = ""
    if all(m is not None for _, m, _ in measured):
        clocks = (f", SM clock {statistics.median(m for _, m, _ in measured):.0f} MHz, "
                  f"{statistics.median(w for _, _, w in measured):.0f} W")
    return ms, spread, clocks


def round_order(n: int, r: int) -> list[int]:
    """The order of round r of a bench over n rows: r, r + s, r + 2 s, ... (mod n), with s the
    r-th of the strides coprime with n (cyclically: 1, 3, 5, 7 for 8 rows), so that a row's
    predecessor inside a round, j - s, differs between consecutive rounds and, for 8 rows, over
    any 4 (a cyclic shift alone keeps it; with fewer strides, e.g. 1 and 3 for 4 rows, rounds r
    and r + 2 repeat). Under the power cap a row inherits some of the last one's clock; the
    bench's warm-up in time removes most of that, and these orders spread the rest."""
    if n <= 0:
        return []
    strides = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    s = strides[r % len(strides)]
    return [(r + i * s) % n for i in range(n)]


def warmup_note(payload: dict[str, Any]) -> str:
    """" (and W ms of them)" for a bench JSON that warmed each row up in time, else empty."""
    ms = payload.get("warmup_ms")
    return f" (and {ms:g} ms of them)" if ms else ""


def markdown_table(payload: dict[str, Any]) -> str:
    """The results of a ``bench --json`` file as the markdown table of docs/benchmarks.md."""
    versions = ", ".join(f"{k} {v}" for k, v in payload.get("versions", {}).items() if v)
    lines = [
        f"flashinfer_h3 {payload.get('flashinfer_h3')} on {payload.get('device')}, "
        f"{payload.get('date', 'date unknown')}; {versions}; median of {payload.get('iters')} "
        f"runs after {payload.get('warmup')} warm-up{warmup_note(payload)}"
        f"{rounds_note(payload.get('rounds', 1))}, "
        f"seed {payload.get('seed')}.",
        "",
        "| preset | implementation | ms | TFLOP/s | x cuDNN | rel L2 vs FP32 oracle |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for run in payload["runs"]:
        shape = f"{run['preset']} ({sum(run['lengths']):,} x {run['heads']})"
        cudnn = next((r["ms"] for r in run["results"]
                      if r["name"] == "torch SDPA cuDNN bf16" and r.get("ms")), None)
        for r in run["results"]:
            if r.get("ms") is None:
                lines.append(f"| {shape} | {r['name']} | n/a | | | {r.get('error', '')} |")
                continue
            ratio = f"{cudnn / r['ms']:.2f}" if cudnn else ""
            rel = f"{r['rel_l2']:.4f}" if r.get("rel_l2") is not None else ""
            lines.append(f"| {shape} | {r['name']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                         f"{ratio} | {rel} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m flashinfer_h3.benchtools BENCH.json  (prints a markdown table)")
    with open(sys.argv[1]) as f:
        print(markdown_table(json.load(f)))
