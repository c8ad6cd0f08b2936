"""The compiled modules: which templates make up each ``.so`` and the archs it is built for.

One entry per module (``KernelConfig(module, head_dim, arch)`` builds it). The backends of
``flashinfer_h3/backends.py`` name the module they need; ``warmup`` and the prebuilt wheel build
every production module (``test_only=False``) for each of its archs. A module's templates see
``op`` (the operator whose recipe they implement, or ``None``), ``scale_mode`` (the same),
``head_dim`` and ``arch`` (see ``KernelConfig.template_context``).

Adding a kernel = adding its templates and headers, one :class:`ModuleDef` here and one backend
registration in ``backends.py`` (docs/design.md, "Adding a backend").

Pure data: this module imports nothing from the package (the JIT, the CLI and the backends all
read it).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every architecture a module may be built for (jit/env.py ARCHS holds their details).
ALL_ARCHS: tuple[str, ...] = ("sm_90a", "sm_120a", "sm_121a")


@dataclass(frozen=True)
class ModuleDef:
    """One compiled module."""

    name: str  # the KernelConfig's module name, the prefix of its cache URI
    templates: tuple[str, ...]  # templates/*.cu.jinja, rendered and compiled in this order
    op: str | None  # the operator the templates implement ("nvfp4" | "fp8"), None for helpers
    archs: tuple[str, ...] = ALL_ARCHS  # where it can be built
    exports: tuple[str, ...] = ()  # the tvm-ffi functions it exports (docs/design.md)
    test_only: bool = False  # probes and emulator entry points: never inside a production .so
    about: str = ""
    # ptxas --register-usage-level (0..10; None: ptxas's default, 5) for the module's kernels.
    # ptxas schedules the Hopper kernels' tile loops differently at 0-3, 4-5 and 6-10, and the
    # schedule moves their time by about 1 %: each Hopper module takes the level measured fastest
    # (benchmarks/RESULTS.md, fourteenth session). A KernelConfig flag of the same name overrides
    # it (benchmark builds).
    register_usage_level: int | None = None
    # What the module's pre-pass (quantize.cu.jinja) writes: "codes" (codes and scales, the layouts
    # the mma.sync kernels and the FP8 wgmma kernel read) or "fp16" (op nvfp4 only: the values
    # s * code as FP16, the operands of the Hopper NVFP4 kernel, prepass.cuh's Fp16Outputs).
    prepass_output: str = "codes"
    # The KernelConfig flags the module's builds take (its templates' benchmark-build switches and
    # register_usage_level), or None: any flag, rendered as its templates see it. A name outside
    # the tuple is refused (a misspelt or removed benchmark flag would otherwise build production
    # and be measured against production). tests/jit/test_jit_render.py checks each tuple against
    # the names its templates read.
    flags: tuple[str, ...] | None = None


#: The KernelConfig flag that overrides a module's register_usage_level (read by jit/spec.py).
REGISTER_USAGE_FLAG = "register_usage_level"
#: The flags of the shared pre-pass template (quantize.cu.jinja) and of the JIT itself.
PREPASS_FLAGS: tuple[str, ...] = ("prepass_ctas",)
JIT_FLAGS: tuple[str, ...] = (REGISTER_USAGE_FLAG,)

MODULES: dict[str, ModuleDef] = {}


def check_register_usage_level(level: object, what: str) -> None:
    """Raise ValueError unless ``level`` is None or an int in ptxas's range 0..10."""
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)
                              or not 0 <= level <= 10):
        raise ValueError(f"{what}: expected an int in 0..10 or None, got {level!r}")


def register_module(module: ModuleDef) -> ModuleDef:
    """Add ``module`` to :data:`MODULES` (a name may be registered once)."""
    if module.name in MODULES:
        raise ValueError(f"module {module.name!r} is already registered")
    unknown = [a for a in module.archs if a not in ALL_ARCHS]
    if unknown or not module.archs:
        raise ValueError(f"module {module.name!r}: archs must be among {ALL_ARCHS}, got "
                         f"{module.archs}")
    if not module.templates:
        raise ValueError(f"module {module.name!r} has no templates")
    if module.prepass_output not in ("codes", "fp16") or (
            module.prepass_output == "fp16" and module.op != "nvfp4"):
        raise ValueError(f"module {module.name!r}: prepass_output must be 'codes', or 'fp16' for "
                         f"op 'nvfp4', got {module.prepass_output!r} (op {module.op!r})")
    check_register_usage_level(module.register_usage_level,
                               f"module {module.name!r}: register_usage_level")
    if module.flags is not None and (
            not isinstance(module.flags, tuple)
            or not all(isinstance(f, str) and f.isidentifier() for f in module.flags)
            or len(set(module.flags)) != len(module.flags)):
        raise ValueError(f"module {module.name!r}: flags must be None or a tuple of distinct "
                         f"identifiers, got {module.flags!r}")
    MODULES[module.name] = module
    return module


def production_modules() -> tuple[ModuleDef, ...]:
    return tuple(m for m in MODULES.values() if not m.test_only)


register_module(ModuleDef(
    "utils", ("utils.cu.jinja",), None, exports=("fill_u8", "build_info", "epilogue_divide"),
    about="device helpers of the tests and the operators (byte fill, the epilogue's division), "
    "build info",
))
register_module(ModuleDef(
    "nvfp4", ("quantize.cu.jinja", "attention_nvfp4.cu.jinja"), "nvfp4",
    exports=("quantize_nvfp4", "attention_nvfp4", "attention_nvfp4_smem_bytes"),
    about="NVFP4 pre-pass + the mma.sync NVFP4 kernel (native MMA on sm_120a, emulated on sm_90a)",
    flags=PREPASS_FLAGS + JIT_FLAGS,
))
register_module(ModuleDef(
    "fp8", ("quantize.cu.jinja", "attention_fp8_mma_sync.cu.jinja"), "fp8",
    exports=("quantize_fp8", "attention_fp8_mma_sync", "attention_fp8_mma_sync_smem_bytes"),
    about="FP8 pre-pass + the mma.sync FP8 kernel (QMMA.16832 on sm_120a; on sm_90a ptxas lowers "
          "the same E4M3 mma.sync to F16 unpacks + HMMA)",
    flags=PREPASS_FLAGS + JIT_FLAGS,
))
register_module(ModuleDef(
    "fp8_wgmma", ("quantize.cu.jinja", "attention_fp8_wgmma.cu.jinja"), "fp8", archs=("sm_90a",),
    exports=("quantize_fp8", "attention_fp8_wgmma", "attention_fp8_wgmma_smem_bytes"),
    about="FP8 pre-pass + the Hopper FP8 kernel: warp-specialised, TMA + mbarriers, E4M3 wgmma, "
          "two consumer warpgroups in ping-pong",
    register_usage_level=8,
    flags=PREPASS_FLAGS + JIT_FLAGS + (
        "background_traffic", "cluster_ctas", "dynamic_schedule", "interleaved_pack", "kv_copies",
        "o_update", "ping_pong", "poly_exp2_every", "q_in_kernel", "smem_carveout",
        "softmax", "stages", "tile_keys", "wait_sleep_ns"),
))
register_module(ModuleDef(
    "nvfp4_wgmma", ("quantize.cu.jinja", "attention_nvfp4_wgmma.cu.jinja"), "nvfp4",
    archs=("sm_90a",),
    exports=("quantize_nvfp4_fp16", "attention_nvfp4_wgmma", "attention_nvfp4_wgmma_smem_bytes"),
    about="NVFP4 pre-pass writing FP16 operands + the Hopper NVFP4 kernel: warp-specialised, TMA "
          "+ mbarriers, FP16 wgmma on the exactly dequantised operands, P quantised in registers",
    register_usage_level=8,
    prepass_output="fp16",
    flags=PREPASS_FLAGS + JIT_FLAGS + (
        "background_traffic", "delta", "delta_mma_sync", "delta_wgmma_regs", "dynamic_schedule",
        "f16_rounding", "fast_rounding", "fold_p_scale", "k_stages", "kv_copies", "ping_pong",
        "poly_exp2_every", "quantize_p", "smem_carveout", "softmax", "v_stages", "wait_sleep_ns",
        "wide_consumers"),
))
register_module(ModuleDef(
    "nvfp4_mma_probe", ("mma_probe_nvfp4.cu.jinja",), "nvfp4", exports=("mma_nvfp4_probe",),
    test_only=True,
    about="tests: one block-scaled FP4 MMA of the mma.sync layer against its PTX contract",
))
