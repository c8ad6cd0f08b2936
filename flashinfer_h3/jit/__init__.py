"""JIT compilation of flashinfer_h3's CUDA kernels (Jinja -> nvcc via ninja -> tvm-ffi module).

Public entry points:

- :func:`get_module` (module, device): the loaded module for the device's architecture.
- :func:`build_module` (config): the ``.so`` path, building if needed (no GPU needed).
- :func:`detect_arch` (device): ``sm_90a`` / ``sm_120a`` / ``sm_121a``, or a ``RuntimeError``.
- :class:`KernelConfig`: what a module is compiled for.
"""

from .build import build_module, generate_ninja, read_manifest, valid_so
from .env import (
    ARCHS,
    SUPPORTED_ARCHS,
    JitBuildError,
    JitError,
    MissingJitCacheError,
    MissingToolchainError,
    TemplateNotFoundError,
    UnsupportedArchError,
    arch_for_capability,
    cache_dir,
    cache_root,
    detect_arch,
    find_nvcc,
    normalize_arch,
    parse_arch_list,
    templates_dir,
)
from .load import (
    clear_module_cache,
    export_prebuilt,
    find_prebuilt,
    get_module,
    list_prebuilt,
    load_so,
    prebuilt_dirs,
)
from .render import render_template, render_templates
from .spec import (
    OP_SOURCES,
    OPS,
    JitSpec,
    KernelConfig,
    compute_uri,
    make_spec,
    production_configs,
)

__all__ = [
    "ARCHS",
    "OPS",
    "OP_SOURCES",
    "SUPPORTED_ARCHS",
    "JitBuildError",
    "JitError",
    "JitSpec",
    "KernelConfig",
    "MissingJitCacheError",
    "MissingToolchainError",
    "TemplateNotFoundError",
    "UnsupportedArchError",
    "arch_for_capability",
    "build_module",
    "cache_dir",
    "cache_root",
    "clear_module_cache",
    "compute_uri",
    "detect_arch",
    "export_prebuilt",
    "find_nvcc",
    "find_prebuilt",
    "generate_ninja",
    "get_module",
    "list_prebuilt",
    "load_so",
    "make_spec",
    "normalize_arch",
    "parse_arch_list",
    "prebuilt_dirs",
    "production_configs",
    "read_manifest",
    "render_template",
    "render_templates",
    "templates_dir",
    "valid_so",
]
