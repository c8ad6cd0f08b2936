"""The backend registry: which code runs an operator on a GPU.

A :class:`Backend` says what runs one operator (``nvfp4`` or ``fp8``): a kernel of a JIT module or
the torch reference, the workspace layout it reads, how its launches are made, whether it can be
captured into a CUDA graph, the GPU architectures it runs on and where ``auto`` picks it (with a
priority: the highest among the backends registered for an arch wins).

Registered here (docs/design.md, "Backends"):

=========================  ========  ==========  =====================================  ========
name                       operator  kind        runs on (auto)                         module
=========================  ========  ==========  =====================================  ========
``mma_sync_fp4``           nvfp4     kernel      sm_120a, sm_121a (auto)                nvfp4
``mma_sync_fp4_emulated``  nvfp4     kernel      sm_90a: the same source, the emulated  nvfp4
                                                 FP4 MMA layer (tests the SM120 source)
``wgmma_fp16_nvfp4``       nvfp4     kernel      sm_90a (auto): TMA + ping-pong         nvfp4_wgmma
                                                 warpgroups, FP16 wgmma on the exactly
                                                 dequantised operands
``mma_sync_fp8``           fp8       kernel      sm_120a, sm_121a, sm_90a (auto; on     fp8
                                                 sm_90a until wgmma_fp8): the same source
``wgmma_fp8``              fp8       kernel      sm_90a (auto, above mma_sync_fp8): TMA   fp8_wgmma
                                                 + ping-pong warpgroups, E4M3 wgmma
``reference``              both      reference   any CUDA GPU (auto where no kernel     --
                                                 is registered): the torch emulation
=========================  ========  ==========  =====================================  ========

Choosing a backend, per operator (the first that is set wins):

1. ``with flashinfer_h3.use_backend("fp8", "reference"): ...`` (this thread / task only);
2. ``flashinfer_h3.set_backend("fp8", "reference")`` (the process; ``None`` clears it);
3. the environment: ``FLASHINFER_H3_NVFP4_BACKEND`` / ``FLASHINFER_H3_FP8_BACKEND``;
4. ``auto``.

A value is ``auto`` or a backend name (the NVFP4 names of earlier releases, ``sm120`` and
``sm120_emulated``, are accepted as aliases). An unknown name is a ``ValueError``; a backend that
cannot run on this GPU is a ``RuntimeError`` naming it, the GPU's compute capability and the
backends that can.

The call path asks :func:`prepared` once per call: a dict lookup on ``(op, device, choice)``.
The first lookup resolves the backend, loads its JIT module and builds its launcher; the
launcher binds the arguments that are fixed for a plan and workspace once (see
:class:`PlanArgs`).

Import cost: this module imports neither torch nor the JIT at import time (``python -m
flashinfer_h3 info --arch sm_90a`` works without a GPU and without torch).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .jit.env import UnsupportedArchError, arch_for_capability
from .jit.modules import ALL_ARCHS, MODULES

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from .plan import Plan

OPERATORS: tuple[str, ...] = ("nvfp4", "fp8")
KERNEL, REFERENCE = "kernel", "reference"
AUTO = "auto"
ENV_BACKEND: dict[str, str] = {
    "nvfp4": "FLASHINFER_H3_NVFP4_BACKEND",
    "fp8": "FLASHINFER_H3_FP8_BACKEND",
}
#: The workspace layout names of flashinfer_h3/layout.py (workspace.layout_for).
WORKSPACE_LAYOUTS: tuple[str, ...] = ("nvfp4", "nvfp4_fp16", "fp8", "fp8_sm90")

#: ``launch(q, k, v, out, softmax_scale, bounds, plan, views)``: one call's work on torch's
#: current stream. ``plan`` and ``views`` are None / () for a backend without a workspace.
#: A kernel backend's launch also has ``launch.attention_only`` (same arguments): its attention
#: kernel alone, reading the operands an earlier launch's pre-pass left in ``views`` (benchmarks
#: time it as "kernel only"), and ``launch.prepass_only``: the pre-pass alone
#: (benchmarks/bench_call_breakdown.py).
Launch = Callable[..., None]
#: ``make_launcher(module, backend) -> Launch``: ``module`` is the loaded JIT module (None for a
#: backend without one).
LauncherFactory = Callable[[Any, "Backend"], Launch]


@dataclass(frozen=True)
class Backend:
    """One way to run one operator."""

    name: str  # what runs, e.g. "mma_sync_fp4"; unique per operator
    op: str  # "nvfp4" | "fp8"
    kind: str  # "kernel" | "reference" (the torch emulation)
    make_launcher: LauncherFactory
    module: str | None = None  # JIT module (jit/modules.py); None: nothing to build
    workspace: str | None = None  # workspace layout (layout.py); None: no plan, no workspace
    capturable: bool = False  # may run while a CUDA graph is being captured
    archs: tuple[str, ...] = ()  # where it runs; () = any CUDA GPU
    auto: tuple[tuple[str, int], ...] = ()  # (arch, priority) where auto picks it; "*" = any
    aliases: tuple[str, ...] = ()  # older names accepted for it
    summary: str = ""  # one line for `python -m flashinfer_h3 info`

    def runs_on(self, arch: str) -> bool:
        return not self.archs or arch in self.archs

    def auto_priority(self, arch: str) -> int | None:
        """The priority with which ``auto`` picks this backend on ``arch`` (None: never)."""
        best = None
        for where, priority in self.auto:
            if (where == arch or where == "*") and (best is None or priority > best):
                best = priority
        return best if best is not None and self.runs_on(arch) else None

    @property
    def is_kernel(self) -> bool:
        return self.kind == KERNEL

    @property
    def label(self) -> str:
        """``mma_sync_fp4 (kernel)`` / ``reference (torch emulation)``."""
        return f"{self.name} ({'kernel' if self.is_kernel else 'torch emulation'})"


@dataclass(frozen=True)
class Prepared:
    """A resolved backend with its launcher, as a call gets it."""

    backend: Backend
    launch: Launch
    device: Any = None

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def workspace(self) -> str | None:
        return self.backend.workspace

    @property
    def capturable(self) -> bool:
        return self.backend.capturable


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------

_REGISTRY: dict[str, dict[str, Backend]] = {op: {} for op in OPERATORS}


def register(backend: Backend) -> Backend:
    """Add ``backend`` to the registry (checked: operator, kind, names, module, archs)."""
    if backend.op not in OPERATORS:
        raise ValueError(f"backend {backend.name!r}: unknown operator {backend.op!r}")
    if backend.kind not in (KERNEL, REFERENCE):
        raise ValueError(f"backend {backend.name!r}: kind must be 'kernel' or 'reference'")
    table = _REGISTRY[backend.op]
    for name in (backend.name, *backend.aliases):
        if name == AUTO or name in table or name in _aliases(backend.op):
            raise ValueError(f"{backend.op} backend name {name!r} is taken")
    unknown = [a for a in backend.archs if a not in ALL_ARCHS]
    unknown += [a for a, _ in backend.auto if a != "*" and a not in ALL_ARCHS]
    if unknown:
        raise ValueError(f"backend {backend.name!r}: unknown arch(s) {', '.join(unknown)}")
    if backend.kind == KERNEL:
        if backend.module not in MODULES:
            raise ValueError(f"backend {backend.name!r}: module {backend.module!r} is not in "
                             "jit/modules.py")
        built_for = MODULES[backend.module].archs
        if not backend.archs or any(a not in built_for for a in backend.archs):
            raise ValueError(f"backend {backend.name!r}: runs on {backend.archs}, but module "
                             f"{backend.module!r} is built for {built_for}")
        if backend.workspace not in WORKSPACE_LAYOUTS:
            raise ValueError(f"backend {backend.name!r}: workspace must be one of "
                             f"{WORKSPACE_LAYOUTS}")
    table[backend.name] = backend
    reset()
    return backend


def unregister(op: str, name: str) -> None:
    """Remove a backend (tests)."""
    _REGISTRY[op].pop(name, None)
    reset()


def _aliases(op: str) -> dict[str, str]:
    return {alias: b.name for b in _REGISTRY[op].values() for alias in b.aliases}


def backends(op: str) -> tuple[Backend, ...]:
    """The registered backends of ``op``, in registration order."""
    _check_op(op)
    return tuple(_REGISTRY[op].values())


def get(op: str, name: str) -> Backend:
    """The backend ``name`` (or an alias of it) of ``op``; ValueError when there is none."""
    _check_op(op)
    table = _REGISTRY[op]
    canonical = _aliases(op).get(name, name)
    if canonical not in table:
        raise ValueError(f"{name!r} is not a {op} backend; expected {_choices_text(op)}")
    return table[canonical]


def _check_op(op: str) -> None:
    if op not in _REGISTRY:
        raise ValueError(f"unknown operator {op!r}; expected one of {', '.join(OPERATORS)}")


def _choices_text(op: str) -> str:
    names = [AUTO, *_REGISTRY[op]]
    text = ", ".join(names)
    aliases = _aliases(op)
    if aliases:
        text += " (aliases: " + ", ".join(f"{a} = {n}" for a, n in aliases.items()) + ")"
    return text


# ---------------------------------------------------------------------------------------------
# Resolution: (operator, GPU, choice) -> backend; pure logic, no GPU needed
# ---------------------------------------------------------------------------------------------


def resolve_for_arch(op: str, arch: str, choice: str = AUTO, *,
                     capability: tuple[int, int] | None = None,
                     source: str | None = None) -> Backend:
    """The backend of ``op`` on a GPU of kernel architecture ``arch`` for ``choice``.

    ``source`` names where the choice came from, for messages (default: the env variable).
    """
    _check_op(op)
    source = source or ENV_BACKEND[op]
    choice = (choice or AUTO).strip().lower() or AUTO
    cap_text = _cap_text(arch, capability)
    if choice == AUTO:
        ranked = [(b.auto_priority(arch), i, b) for i, b in enumerate(_REGISTRY[op].values())]
        ranked = [r for r in ranked if r[0] is not None]
        if not ranked:
            raise UnsupportedArchError(f"no {op} backend runs on compute capability {cap_text}")
        return max(ranked, key=lambda r: (r[0], -r[1]))[2]
    try:
        backend = get(op, choice)
    except ValueError:
        raise ValueError(f"{source}={choice!r} is not a backend; expected one of "
                         f"{_choices_text(op)}") from None
    if not backend.runs_on(arch):
        able = [b.name for b in sorted(_REGISTRY[op].values(), key=lambda b: not b.is_kernel)
                if b.runs_on(arch)]  # kernels first
        shown = choice if choice == backend.name else f"{choice} (now named {backend.name})"
        raise RuntimeError(
            f"{source}={shown} needs compute capability {_archs_text(backend.archs)}, but "
            f"this GPU is {cap_text}; the {op} backends that run here: "
            f"{', '.join(able + [AUTO])}"
        )
    return backend


def resolve(op: str, capability: tuple[int, int], choice: str = AUTO, *,
            source: str | None = None) -> Backend:
    """The backend of ``op`` on a GPU of compute ``capability`` for ``choice``.

    A GPU the library has no kernels for raises ``UnsupportedArchError`` (a ``RuntimeError``
    naming its compute capability and the supported ones), except for an explicit choice of a
    backend that runs on any GPU (the reference).
    """
    _check_op(op)
    major, minor = capability
    choice = (choice or AUTO).strip().lower() or AUTO
    try:
        arch = arch_for_capability(major, minor)
    except UnsupportedArchError:
        if choice != AUTO and _any_gpu(op, choice):  # the reference runs on any CUDA GPU
            return resolve_for_arch(op, "", choice, capability=capability, source=source)
        raise
    return resolve_for_arch(op, arch, choice, capability=capability, source=source)


def _any_gpu(op: str, choice: str) -> bool:
    """Whether ``choice`` names a backend of ``op`` that runs on any CUDA GPU."""
    try:
        return not get(op, choice).archs
    except ValueError:
        return True  # let resolve_for_arch raise the unknown-name error


def _cap_text(arch: str, capability: tuple[int, int] | None) -> str:
    if capability is not None:
        return f"{capability[0]}.{capability[1]}"
    from .jit.env import ARCHS

    info = ARCHS.get(arch)
    return f"{info.capability[0]}.{info.capability[1]} ({arch})" if info else arch


def _archs_text(archs: Sequence[str]) -> str:
    from .jit.env import ARCHS

    caps = [f"{ARCHS[a].capability[0]}.{ARCHS[a].capability[1]}" for a in archs if a in ARCHS]
    majors = {c.split(".")[0] for c in caps}
    if len(caps) > 1 and len(majors) == 1:
        return f"{majors.pop()}.x"
    return " or ".join(caps) or "any"


# ---------------------------------------------------------------------------------------------
# The user's choice
# ---------------------------------------------------------------------------------------------

_PROCESS_CHOICE: dict[str, str] = {}
_SCOPED_CHOICE: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "flashinfer_h3_backend", default=()
)


def _validate_choice(op: str, name: str, source: str) -> str:
    _check_op(op)
    if not isinstance(name, str):
        raise TypeError(f"{source}: the backend must be a str, got {type(name).__name__}")
    value = name.strip().lower() or AUTO
    if value != AUTO:
        try:
            get(op, value)
        except ValueError:
            raise ValueError(f"{source}: {name!r} is not a {op} backend; expected one of "
                             f"{_choices_text(op)}") from None
    return value


def set_backend(op: str, name: str | None) -> None:
    """Choose the backend of operator ``op`` for the whole process (``"auto"``, a backend name,
    or ``None`` to fall back to the environment variable). Takes effect at the next call."""
    if name is None:
        _check_op(op)
        _PROCESS_CHOICE.pop(op, None)
        return
    _PROCESS_CHOICE[op] = _validate_choice(op, name, f"set_backend({op!r}, ...)")


@contextlib.contextmanager
def use_backend(op: str, name: str) -> Iterator[None]:
    """``with use_backend("fp8", "reference"): ...``: the backend of ``op`` inside the block,
    for this thread (or asyncio task) only; blocks nest."""
    value = _validate_choice(op, name, f"use_backend({op!r}, ...)")
    token = _SCOPED_CHOICE.set(_SCOPED_CHOICE.get() + ((op, value),))
    try:
        yield
    finally:
        _SCOPED_CHOICE.reset(token)


def current_choice(op: str) -> tuple[str, str]:
    """``(choice, where it comes from)`` for ``op``: use_backend, set_backend, env, or auto."""
    for scoped_op, value in reversed(_SCOPED_CHOICE.get()):
        if scoped_op == op:
            return value, f"use_backend({op!r}, ...)"
    value = _PROCESS_CHOICE.get(op)
    if value is not None:
        return value, f"set_backend({op!r}, ...)"
    env = ENV_BACKEND[op]
    raw = os.environ.get(env)
    if raw is not None and raw.strip():
        return raw.strip().lower(), env
    return AUTO, env


# ---------------------------------------------------------------------------------------------
# Prepared backends of the call path
# ---------------------------------------------------------------------------------------------

_PREPARED: dict[tuple[str, Any, str], Prepared] = {}
_PREPARED_LOCK = threading.Lock()


def prepared(op: str, device: torch.device) -> Prepared:
    """The backend of ``op`` on ``device`` for the current choice, with its launcher; resolved,
    loaded and built once per ``(op, device, choice)``. RuntimeError before any launch when the
    GPU has no backend, the chosen one cannot run on it or no toolchain can build its module."""
    if _SCOPED_CHOICE.get():
        choice = current_choice(op)[0]
    else:  # the common case, inlined: no use_backend block is active
        choice = _PROCESS_CHOICE.get(op)
        if choice is None:
            raw = os.environ.get(ENV_BACKEND[op])
            choice = raw.strip().lower() if raw and raw.strip() else AUTO
    key = (op, device, choice)
    entry = _PREPARED.get(key)
    if entry is None:
        with _PREPARED_LOCK:
            entry = _PREPARED.get(key)
            if entry is None:
                entry = _prepare(op, device, choice)
                _PREPARED[key] = entry
    return entry


def _prepare(op: str, device: torch.device, choice: str) -> Prepared:
    import torch

    _, source = current_choice(op)
    capability = torch.cuda.get_device_capability(device)
    backend = resolve(op, capability, choice, source=source)
    module = None
    if backend.module is not None:
        from .jit import get_module

        module = get_module(backend.module, device)  # RuntimeError when it cannot be built
    return Prepared(backend, backend.make_launcher(module, backend), device)


def cache_key(op: str, device: torch.device) -> tuple[str, Any, str]:
    """The key of :func:`prepared`'s cache for the current choice (benchmarks swap entries)."""
    choice, _ = current_choice(op)
    return op, device, choice


def reset() -> None:
    """Forget the prepared backends (after registering one, or in tests). The choice itself is
    read on every call."""
    with _PREPARED_LOCK:
        _PREPARED.clear()


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


@dataclass
class PlanArgs:
    """The launch arguments derived from one (plan, workspace views) pair, built once and reused
    while consecutive calls have the same plan and views (the common case: a model's layers
    call with one shape). One entry; the derived arguments reference the plan and the views,
    so nothing is kept beyond the most recent pair."""

    derive: Callable[[Plan, tuple[Tensor, ...]], Any]
    _entry: tuple[Any, Any, Any] | None = field(default=None, repr=False)

    def get(self, plan: Plan, views: tuple[Tensor, ...]) -> Any:
        if getattr(plan, "captured", False):
            # A call being captured: its tables and workspace are temporaries of the capture's
            # memory pool, freed when the call returns. Keeping them here would pin them (torch
            # .compile's cudagraph trees then refuse the graph: "tensor(s) in the cudagraph pool
            # not tracked as outputs").
            return self.derive(plan, views)
        entry = self._entry
        if entry is not None and entry[0] is plan and entry[1] is views:
            return entry[2]
        value = self.derive(plan, views)
        self._entry = (plan, views, value)  # one assignment: safe with concurrent readers
        return value


#: ``derive(plan, views) -> (quantize_args, attention_args, attention_tail)``: the arguments of
#: the two tvm-ffi calls of a kernel backend that are fixed for a (plan, views) pair.
Derive = Callable[..., tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]]


def prepass_attention_launcher(quantize: Callable[..., None], attention: Callable[..., None],
                               derive: Derive, attention_takes_q: bool = False) -> Launch:
    """The launch of a kernel backend: ``quantize(q, k, v, *quantize_args)`` (the pre-pass), then
    ``attention(out, *attention_args, softmax_scale, *attention_tail)``, the arguments derived
    once per (plan, views) pair (:class:`PlanArgs`); ``attention_takes_q``: ``attention(out, q,
    *attention_args, ...)`` (the Hopper FP8 kernel, which may quantise Q itself)."""
    bound = PlanArgs(derive)

    def run_attention(q: Tensor, out: Tensor, scale: float, attention_args: tuple[Any, ...],
                      tail: tuple[Any, ...]) -> None:
        if attention_takes_q:
            attention(out, q, *attention_args, scale, *tail)
        else:
            attention(out, *attention_args, scale, *tail)

    def launch(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float,
               bounds: tuple[int, ...], plan: Plan, views: tuple[Tensor, ...]) -> None:
        quantize_args, attention_args, tail = bound.get(plan, views)
        quantize(q, k, v, *quantize_args)
        run_attention(q, out, scale, attention_args, tail)

    def attention_only(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float,
                       bounds: tuple[int, ...], plan: Plan, views: tuple[Tensor, ...]) -> None:
        _, attention_args, tail = bound.get(plan, views)
        run_attention(q, out, scale, attention_args, tail)

    def prepass_only(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float,
                     bounds: tuple[int, ...], plan: Plan, views: tuple[Tensor, ...]) -> None:
        quantize_args, _, _ = bound.get(plan, views)
        quantize(q, k, v, *quantize_args)

    launch.attention_only = attention_only  # type: ignore[attr-defined]
    launch.prepass_only = prepass_only  # type: ignore[attr-defined]
    return launch


def mma_sync_fp4_launcher(module: Any, backend: Backend) -> Launch:
    """The NVFP4 pre-pass and the mma.sync attention kernel of module ``nvfp4``."""

    def derive(plan: Plan, views: tuple[Tensor, ...]) -> Any:
        seg_bounds, vkey_start, qblock_start, qblocks = plan.args
        # views: kbar, qbar, q_codes, q_scales, k_codes, k_scales, v_codes, v_scales
        return ((seg_bounds, vkey_start, qblock_start, qblocks, *views),
                (*views[1:], seg_bounds, vkey_start, qblocks), ())

    return prepass_attention_launcher(module.quantize_nvfp4, module.attention_nvfp4, derive)


def mma_sync_fp8_launcher(module: Any, backend: Backend) -> Launch:
    """The FP8 pre-pass and the mma.sync FP8 attention kernel of module ``fp8``."""

    def derive(plan: Plan, views: tuple[Tensor, ...]) -> Any:
        # views: kbar, q_codes, q_scales, k_codes, k_scales, v_codes, v_scales
        tables = plan.args  # seg_bounds, vkey_start, qblock_start, qblocks
        return (*tables, *views), (*views[1:], *tables), ()

    return prepass_attention_launcher(module.quantize_fp8, module.attention_fp8_mma_sync, derive)


def wgmma_fp8_launcher(module: Any, backend: Backend) -> Launch:
    """The FP8 pre-pass and the Hopper wgmma FP8 kernel of module ``fp8_wgmma``. The kernel also
    takes the plan's item schedule (its CTAs' lists of items, :func:`plan.item_schedule`, for
    the build's CTAs a cluster: :meth:`plan.Plan.schedule_for`) and used V columns
    (``vkey_start[S]``): its V tensor map ends there."""
    from .plan import cluster_ctas_of

    cluster_ctas = cluster_ctas_of(module)  # production: the plans' own (FP8_CLUSTER_CTAS)

    def derive(plan: Plan, views: tuple[Tensor, ...]) -> Any:
        # views: kbar, q_codes, q_scales, k_codes, k_scales, v_codes, v_scales, item_counter
        tables = plan.args  # seg_bounds, vkey_start, qblock_start, qblocks
        operands, counter = views[:7], views[7]
        schedule = plan.schedule_for(cluster_ctas)
        return ((*tables, *operands), (*operands[1:], *tables, counter, *schedule),
                (plan.host.vkey_start[-1],))

    return prepass_attention_launcher(module.quantize_fp8, module.attention_fp8_wgmma, derive,
                                      attention_takes_q=True)


def wgmma_fp16_nvfp4_launcher(module: Any, backend: Backend) -> Launch:
    """The NVFP4 pre-pass that writes the FP16 operands (``quantize_nvfp4_fp16``: means, then
    q_f16, k_f16, v_f16; no codes) and the Hopper NVFP4 kernel of module ``nvfp4_wgmma``. The
    kernel takes the plan's used V columns (``vkey_start[S]``): its K and V tensor maps end
    there."""

    def derive(plan: Plan, views: tuple[Tensor, ...]) -> Any:
        tables = plan.args  # seg_bounds, vkey_start, qblock_start, qblocks
        # views: kbar, qbar, q_f16, k_f16, v_f16, item_counter
        kbar, qbar, q_f16, k_f16, v_f16, counter = views
        fp16 = (q_f16, k_f16, v_f16)
        return ((*tables, kbar, qbar, *fp16), (qbar, *fp16, *tables, counter),
                (plan.host.vkey_start[-1],))

    return prepass_attention_launcher(module.quantize_nvfp4_fp16, module.attention_nvfp4_wgmma,
                                      derive)


def reference_launcher(module: Any, backend: Backend) -> Launch:
    """The torch emulation of the operator's recipe (reference.py), on the call's device."""
    from . import reference

    fn = {"nvfp4": reference.varlen_attention_nvfp4_reference,
          "fp8": reference.varlen_attention_fp8_reference}[backend.op]

    def launch(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float,
               bounds: tuple[int, ...], plan: Plan | None, views: tuple[Tensor, ...]) -> None:
        out.copy_(fn(q, k, v, bounds, scale))  # host bounds: no D2H copy of cu_seqlens

    return launch


# ---------------------------------------------------------------------------------------------
# Registrations. A new backend: its module in jit/modules.py, its templates and headers, its
# launcher factory (here or in its own file), and one register() call below
# (docs/design.md, "Adding a backend").
# ---------------------------------------------------------------------------------------------

register(Backend(
    "mma_sync_fp4", "nvfp4", KERNEL, mma_sync_fp4_launcher, module="nvfp4", workspace="nvfp4",
    capturable=True, archs=("sm_120a", "sm_121a"), auto=(("sm_120a", 10), ("sm_121a", 10)),
    aliases=("sm120",),
    summary="mma.sync NVFP4 kernel, block-scaled FP4 MMA (OMMA.SF.16864)",
))
register(Backend(
    "mma_sync_fp4_emulated", "nvfp4", KERNEL, mma_sync_fp4_launcher, module="nvfp4",
    workspace="nvfp4", capturable=True, archs=("sm_90a",), auto=(("sm_90a", 10),),
    aliases=("sm120_emulated",),
    summary="the mma.sync NVFP4 kernel with the emulated FP4 MMA layer (exact FP16 HMMA)",
))
register(Backend(
    "wgmma_fp16_nvfp4", "nvfp4", KERNEL, wgmma_fp16_nvfp4_launcher, module="nvfp4_wgmma",
    workspace="nvfp4_fp16", capturable=True, archs=("sm_90a",), auto=(("sm_90a", 20),),
    summary="Hopper NVFP4 kernel: TMA producer + two ping-pong consumer warpgroups, FP16 wgmma "
            "(HGMMA.64x128x16.F32) on the exactly dequantised operands, P quantised in registers",
))
register(Backend(
    "mma_sync_fp8", "fp8", KERNEL, mma_sync_fp8_launcher, module="fp8", workspace="fp8",
    capturable=True, archs=("sm_90a", "sm_120a", "sm_121a"),
    auto=(("sm_120a", 10), ("sm_121a", 10), ("sm_90a", 10)),
    summary="mma.sync FP8 kernel, E4M3 m16n8k32 (QMMA.16832 on SM120; F16 unpacks + HMMA on "
            "sm_90a, lowered by ptxas)",
))
register(Backend(
    "wgmma_fp8", "fp8", KERNEL, wgmma_fp8_launcher, module="fp8_wgmma", workspace="fp8_sm90",
    capturable=True, archs=("sm_90a",), auto=(("sm_90a", 20),),
    summary="Hopper FP8 kernel: TMA producer + two ping-pong consumer warpgroups, E4M3 wgmma "
            "(QGMMA.64x128x32), two-level PV accumulation",
))
for _op in OPERATORS:
    register(Backend(
        REFERENCE, _op, REFERENCE, reference_launcher, capturable=False, archs=(),
        auto=(("*", 0),),
        summary="torch emulation of the recipe (exact, slow, synchronises, not capturable)",
    ))
