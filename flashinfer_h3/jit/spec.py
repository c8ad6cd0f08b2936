"""Kernel configurations and their build specs (rendered sources, flags, cache key).

A :class:`KernelConfig` says *what* to build (module, head_dim, arch, template flags; the
modules and their templates are listed in ``jit/modules.py``); a
:class:`JitSpec` is that configuration made concrete: the rendered sources, the exact nvcc flags
and two digests:

- ``source_key``: SHA-256 over the rendered sources, every header under ``templates/include``,
  the configuration and the flags. It does not depend on the local toolchain, so it is the key
  that prebuilt kernels (built elsewhere) are matched with.
- ``uri``: ``<module>_hd<head_dim>_<arch>_<hash>``, where the hash also covers the nvcc build and
  the tvm-ffi version; it names the JIT cache directory, so any change to a template, header,
  flag or toolchain gives a new directory and a stale ``.so`` is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..constants import HEAD_DIM, RENDERABLE_HEAD_DIMS
from ..version import __version__
from .env import (
    ARCHS,
    cache_dir,
    extra_nvcc_flags,
    include_dir,
    normalize_arch,
    templates_dir,
    tvm_ffi_version,
)
from .modules import (
    MODULES,
    REGISTER_USAGE_FLAG,
    ModuleDef,
    check_register_usage_level,
    production_modules,
)
from .render import render_templates

#: The production modules (built by warmup and the prebuilt wheel) and every module's templates,
#: as read from the table of jit/modules.py at import.
OPS: tuple[str, ...] = tuple(m.name for m in production_modules())
OP_SOURCES: dict[str, tuple[str, ...]] = {m.name: m.templates for m in MODULES.values()}
#: Head dims that are built and offered; a configuration may also be rendered (and hashed) for
#: any of RENDERABLE_HEAD_DIMS.
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (HEAD_DIM,)
DEFAULT_ARCH = "sm_90a"
URI_HASH_CHARS = 16

FlagValue = bool | int | str
_FLAG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _freeze_flags(flags: Any) -> tuple[tuple[str, FlagValue], ...]:
    items = flags.items() if isinstance(flags, Mapping) else flags
    out: dict[str, FlagValue] = {}
    for item in items:
        try:
            name, value = item
        except (TypeError, ValueError):
            raise TypeError(
                f"KernelConfig.flags: expected a mapping or (name, value) pairs, got {flags!r}"
            ) from None
        if not isinstance(name, str) or not _FLAG_NAME.match(name):
            raise ValueError(f"KernelConfig.flags: flag name {name!r} is not an identifier")
        if not isinstance(value, (bool, int, str)):
            raise TypeError(
                f"KernelConfig.flags[{name!r}]: expected bool, int or str, "
                f"got {type(value).__name__}"
            )
        if name in out:
            raise ValueError(f"KernelConfig.flags: flag {name!r} given twice")
        out[name] = value
    return tuple(sorted(out.items()))


def module_names() -> tuple[str, ...]:
    """Every registered module (``jit/modules.py``), production and test-only."""
    return tuple(MODULES)


@dataclass(frozen=True)
class KernelConfig:
    """One compiled module: ``module``, a name of ``jit/modules.py`` (``utils``, ``nvfp4``,
    ``fp8``, ...), ``head_dim`` (128; 64 renders but is not offered), ``arch`` (``sm_90a`` |
    ``sm_120a`` | ``sm_121a``; ``"9.0"``-style names are accepted) and optional template
    ``flags`` (a mapping of identifiers to bool/int/str, seen by every template)."""

    module: str
    head_dim: int = HEAD_DIM
    arch: str = DEFAULT_ARCH
    flags: tuple[tuple[str, FlagValue], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.module not in MODULES:
            raise ValueError(
                f"KernelConfig.module: unknown module {self.module!r}; expected one of "
                f"{', '.join(MODULES)}"
            )
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int):
            raise TypeError(
                f"KernelConfig.head_dim: expected int, got {type(self.head_dim).__name__}"
            )
        if self.head_dim not in RENDERABLE_HEAD_DIMS:
            raise ValueError(
                f"KernelConfig.head_dim: {self.head_dim} is not supported; expected one of "
                f"{RENDERABLE_HEAD_DIMS} (only {HEAD_DIM} is built and offered)"
            )
        if not isinstance(self.arch, str):
            raise TypeError(f"KernelConfig.arch: expected str, got {type(self.arch).__name__}")
        object.__setattr__(self, "arch", normalize_arch(self.arch))
        if self.arch not in self.definition.archs:
            raise ValueError(
                f"KernelConfig: module {self.module!r} is built for "
                f"{', '.join(self.definition.archs)} only, not {self.arch}"
            )
        object.__setattr__(self, "flags", _freeze_flags(self.flags))
        known = self.definition.flags
        unknown = [name for name, _ in self.flags if known is not None and name not in known]
        if unknown:
            raise ValueError(
                f"KernelConfig.flags: module {self.module!r} has no flag "
                f"{', '.join(map(repr, unknown))}; expected among "
                f"{', '.join(sorted(known or ())) or '(none)'}"
            )

    @property
    def definition(self) -> ModuleDef:
        return MODULES[self.module]

    @property
    def op(self) -> str | None:
        """The operator whose recipe the module's templates implement (None for helpers)."""
        return MODULES[self.module].op

    @property
    def scale_mode(self) -> str | None:
        """The quantization recipe of the templates: ``nvfp4`` | ``fp8`` | None."""
        return self.op

    @property
    def templates(self) -> tuple[str, ...]:
        return MODULES[self.module].templates

    @property
    def name(self) -> str:
        """Readable prefix of the URI, e.g. ``nvfp4_hd128_sm90a``."""
        return f"{self.module}_hd{self.head_dim}_{self.arch.replace('_', '')}"

    def template_context(self) -> dict[str, Any]:
        """What every template of the module sees."""
        major, minor = ARCHS[self.arch].capability
        return {
            "module": self.module,
            "op": self.op,
            "scale_mode": self.scale_mode,
            "head_dim": self.head_dim,
            "arch": self.arch,
            "arch_num": major * 10 + minor,  # 90, 120, 121 (the __CUDA_ARCH__ value / 10)
            "prepass_output": self.definition.prepass_output,  # jit/modules.py ModuleDef
            "flags": dict(self.flags),
            "version": __version__,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "head_dim": self.head_dim,
            "arch": self.arch,
            "flags": dict(self.flags),
        }


def cuda_flags(arch: str) -> list[str]:
    """The nvcc compile flags of every module for ``arch`` (includes and env extras excluded)."""
    target = arch.removeprefix("sm_")
    return [
        "-O3",
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        # Only the tvm-ffi exports (marked visibility("default")) leave the .so: two modules never
        # bind each other's kernels or helpers.
        "-Xcompiler",
        "-fvisibility=hidden",
        "--expt-relaxed-constexpr",
        f"-gencode=arch=compute_{target},code=sm_{target}",
        "-lineinfo",
        # ptxas' register/spill report lands in the build log, where tests read it.
        "-Xptxas",
        "-v",
    ]


def module_flags(config: KernelConfig) -> list[str]:
    """The nvcc flags of one configuration beyond :func:`cuda_flags`: its ptxas register usage
    level (the ``register_usage_level`` flag, else the module's; none when both are unset)."""
    level = dict(config.flags).get(REGISTER_USAGE_FLAG, config.definition.register_usage_level)
    check_register_usage_level(level, f"KernelConfig.flags[{REGISTER_USAGE_FLAG!r}]")
    if level is None:
        return []
    return ["-Xptxas", f"--register-usage-level={level}"]


def link_flags() -> list[str]:
    return ["-shared"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def header_digests(directory: Path | None = None) -> dict[str, str]:
    """SHA-256 of every file under ``templates/include`` (relative path -> digest)."""
    root = Path(directory) if directory is not None else include_dir()
    return {
        p.relative_to(root).as_posix(): _sha256(p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def digest_of(payload: Mapping[str, Any]) -> str:
    return _sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())


def compute_source_key(
    config: KernelConfig,
    sources: Mapping[str, str],
    headers: Mapping[str, str],
    compile_flags: list[str],
    ld_flags: list[str],
) -> str:
    return digest_of(
        {
            "flashinfer_h3": __version__,
            "config": config.describe(),
            "sources": {name: _sha256(text.encode()) for name, text in sources.items()},
            "headers": dict(headers),
            "cuda_flags": list(compile_flags),
            "ld_flags": list(ld_flags),
        }
    )


def compute_uri(config: KernelConfig, source_key: str, nvcc_version: str, tvm_ffi: str) -> str:
    digest = digest_of({"source_key": source_key, "nvcc": nvcc_version, "tvm_ffi": tvm_ffi})
    return f"{config.name}_{digest[:URI_HASH_CHARS]}"


@dataclass(frozen=True)
class JitSpec:
    config: KernelConfig
    sources: tuple[tuple[str, str], ...]  # (rendered file name, text), in template order
    cuda_flags: tuple[str, ...]  # base flags + the module's + FLASHINFER_H3_NVCC_FLAGS
    ld_flags: tuple[str, ...]
    source_key: str
    tvm_ffi_version: str

    def uri(self, nvcc_version: str) -> str:
        return compute_uri(self.config, self.source_key, nvcc_version, self.tvm_ffi_version)

    def build_dir(self, nvcc_version: str) -> Path:
        return cache_dir(self.config.arch) / self.uri(nvcc_version)

    def so_path(self, nvcc_version: str) -> Path:
        uri = self.uri(nvcc_version)
        return cache_dir(self.config.arch) / uri / f"{uri}.so"


def make_spec(config: KernelConfig, template_dir: Path | None = None) -> JitSpec:
    """Render the configuration's templates and fix its flags and source key (no nvcc needed)."""
    directory = Path(template_dir) if template_dir is not None else templates_dir()
    sources = render_templates(config.templates, config.template_context(), directory)
    flags = cuda_flags(config.arch) + module_flags(config) + extra_nvcc_flags()
    ld = link_flags()
    key = compute_source_key(config, sources, header_digests(directory / "include"), flags, ld)
    return JitSpec(
        config=config,
        sources=tuple(sources.items()),
        cuda_flags=tuple(flags),
        ld_flags=tuple(ld),
        source_key=key,
        tvm_ffi_version=tvm_ffi_version(),
    )


def production_configs(
    archs: Iterable[str], names: Iterable[str] | None = None
) -> list[KernelConfig]:
    """The configuration of every production module of ``jit/modules.py`` (or of those named
    in ``names``: module names, or an operator such as ``fp8`` for all of its modules) for each
    of ``archs`` it is built for, at the offered head dim. Ordered by arch, then table order."""
    wanted = None if names is None else tuple(names)
    operators = {m.op for m in MODULES.values() if m.op}
    unknown = [n for n in wanted or () if n not in MODULES and n not in operators]
    if unknown:
        raise ValueError(
            f"unknown module(s) {', '.join(unknown)}; expected one of {', '.join(OPS)} "
            f"(or an operator: {', '.join(sorted(operators))})"
        )
    return [
        KernelConfig(m.name, head_dim, arch)
        for arch in (normalize_arch(a) for a in archs)
        for m in production_modules()
        if arch in m.archs and (wanted is None or m.name in wanted or m.op in wanted)
        for head_dim in SUPPORTED_HEAD_DIMS
    ]
