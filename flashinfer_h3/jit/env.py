"""The JIT's view of the machine: directories, toolchain, GPU architecture, environment switches.

Environment variables (all optional):

``FLASHINFER_H3_CACHE_DIR``
    root of the kernel cache (default ``~/.cache/flashinfer_h3``); modules live in
    ``<root>/<version>/<arch>/<uri>/``.
``FLASHINFER_H3_CUDA_ARCH_LIST``
    architectures to use instead of asking the GPU, e.g. ``"sm_90a"`` or ``"9.0 12.0"``
    (separated by spaces, commas or semicolons). For a device, the entry matching its compute
    capability is used; without a GPU, the first entry.
``FLASHINFER_H3_DISABLE_JIT``
    ``1`` turns a cache miss (no prebuilt and no cached kernel) into an error instead of a compile.
``FLASHINFER_H3_NVCC_FLAGS``
    extra nvcc flags appended to every compile (shell syntax); they are part of the cache key.
``FLASHINFER_H3_NVCC``
    the nvcc to use; else ``$CUDA_HOME/bin/nvcc``, ``nvcc`` on ``PATH``,
    ``/usr/local/cuda/bin/nvcc``.
``FLASHINFER_H3_PREBUILT_DIR``
    a directory of prebuilt kernels (``manifest.json`` + ``.so`` files, the layout of the
    ``flashinfer-h3-jit-cache`` wheel), searched before that wheel and before any JIT.
``MAX_JOBS``
    parallel nvcc jobs of one module build (ninja ``-j``).

Nothing here imports torch at module import time, so the CLI's ``warmup --arch`` and the build
tests stay fast and work without a GPU.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..version import __version__

if TYPE_CHECKING:
    import torch

ENV_CACHE_DIR = "FLASHINFER_H3_CACHE_DIR"
ENV_ARCH_LIST = "FLASHINFER_H3_CUDA_ARCH_LIST"
ENV_DISABLE_JIT = "FLASHINFER_H3_DISABLE_JIT"
ENV_NVCC_FLAGS = "FLASHINFER_H3_NVCC_FLAGS"
ENV_NVCC = "FLASHINFER_H3_NVCC"
ENV_PREBUILT_DIR = "FLASHINFER_H3_PREBUILT_DIR"


class JitError(RuntimeError):
    """Base class of the JIT's errors (a ``RuntimeError``, as SPEC 2 promises for toolchain
    problems)."""


class MissingToolchainError(JitError):
    """No nvcc (or one too old for the architecture) and no prebuilt kernel."""


class MissingJitCacheError(JitError):
    """``FLASHINFER_H3_DISABLE_JIT=1`` and the kernel is neither prebuilt nor cached."""


class JitBuildError(JitError):
    """nvcc or ninja failed; the message holds the tail of the build log."""


class TemplateNotFoundError(JitError, FileNotFoundError):
    """A kernel configuration names a template file that does not exist."""


class UnsupportedArchError(JitError):
    """The GPU (or a requested architecture) has no kernels in this library."""


# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchInfo:
    arch: str  # nvcc's name, e.g. "sm_90a"
    capability: tuple[int, int]
    min_cuda: tuple[int, int]  # the first CUDA release whose nvcc knows the target
    gpus: str  # examples, for messages and the README


# The "a" targets: arch-specific features (wgmma on 9.0, block-scaled FP4 mma.sync on 12.x) are
# what the kernels are written for, and an "a" cubin runs only on exactly that capability.
ARCHS: dict[str, ArchInfo] = {
    "sm_90a": ArchInfo("sm_90a", (9, 0), (12, 0), "H100, H200, GH200"),
    "sm_120a": ArchInfo("sm_120a", (12, 0), (12, 8), "RTX 5090, RTX PRO 6000 (GB202)"),
    "sm_121a": ArchInfo("sm_121a", (12, 1), (12, 9), "DGX Spark (GB10)"),
}
SUPPORTED_ARCHS: tuple[str, ...] = tuple(ARCHS)
_BY_CAPABILITY = {info.capability: name for name, info in ARCHS.items()}


def supported_archs_text() -> str:
    return ", ".join(
        f"{info.capability[0]}.{info.capability[1]} ({name}: {info.gpus})"
        for name, info in ARCHS.items()
    )


def arch_for_capability(major: int, minor: int) -> str:
    """``(9, 0) -> "sm_90a"``; a capability without kernels raises UnsupportedArchError."""
    try:
        return _BY_CAPABILITY[(major, minor)]
    except KeyError:
        raise UnsupportedArchError(
            f"flashinfer_h3 has no kernels for GPUs of compute capability {major}.{minor}; "
            f"supported compute capabilities: {supported_archs_text()}"
        ) from None


_ARCH_RE = re.compile(r"^(?:sm_|compute_)?(\d+)\.?(\d)?([af]?)$")


def normalize_arch(text: str) -> str:
    """Accept ``sm_90a``, ``90a``, ``9.0``, ``9.0a``, ``120a``... and return nvcc's name."""
    s = text.strip().lower()
    m = _ARCH_RE.match(s)
    if m is not None:
        digits, minor, _suffix = m.groups()
        if minor is not None:  # "9.0" / "12.0a"
            cap = (int(digits), int(minor))
        elif len(digits) >= 2:  # "90a" / "sm_120a"
            cap = (int(digits[:-1]), int(digits[-1]))
        else:
            cap = None
        if cap is not None and cap in _BY_CAPABILITY:
            return _BY_CAPABILITY[cap]
    raise UnsupportedArchError(
        f"unknown or unsupported CUDA architecture {text!r}; expected one of "
        f"{', '.join(SUPPORTED_ARCHS)} (or the compute capabilities "
        f"{', '.join(f'{a.capability[0]}.{a.capability[1]}' for a in ARCHS.values())})"
    )


def parse_arch_list(text: str) -> list[str]:
    """Split an arch list (spaces, commas or semicolons) into normalized, de-duplicated names."""
    out: list[str] = []
    for item in re.split(r"[\s,;]+", text.strip()):
        if item:
            arch = normalize_arch(item)
            if arch not in out:
                out.append(arch)
    return out


def arch_list_override() -> list[str] | None:
    """The archs of ``FLASHINFER_H3_CUDA_ARCH_LIST``, or None when it is unset or empty."""
    raw = os.environ.get(ENV_ARCH_LIST, "").strip()
    if not raw:
        return None
    try:
        return parse_arch_list(raw)
    except UnsupportedArchError as exc:
        raise UnsupportedArchError(f"{ENV_ARCH_LIST}={raw!r}: {exc}") from None


def detect_arch(device: torch.device | int | str | None = None) -> str:
    """The kernel architecture for ``device`` (default: torch's current CUDA device).

    ``FLASHINFER_H3_CUDA_ARCH_LIST`` takes precedence: with a GPU present, its entry for the
    device's compute capability is used (an override that excludes the GPU is an error, since an
    ``a`` cubin runs only on its own capability); without a GPU, its first entry. Without the
    override, the device's compute capability decides, and an unsupported GPU raises
    :class:`UnsupportedArchError` (a ``RuntimeError``) naming it and the supported ones.
    """
    import torch

    override = arch_list_override()
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    dev: torch.device | None = None
    if device is not None:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"detect_arch: expected a CUDA device, got {dev}")
    if not has_gpu:
        if override:
            return override[0]
        raise UnsupportedArchError(
            "flashinfer_h3 found no CUDA GPU (torch.cuda.is_available() is False) and "
            f"{ENV_ARCH_LIST} is not set; set it (e.g. {ENV_ARCH_LIST}=sm_90a) to build kernels "
            "for a GPU that is not present"
        )
    index = torch.cuda.current_device() if dev is None or dev.index is None else dev.index
    major, minor = torch.cuda.get_device_capability(index)
    if override:
        for arch in override:
            if ARCHS[arch].capability == (major, minor):
                return arch
        raise UnsupportedArchError(
            f"{ENV_ARCH_LIST}={os.environ.get(ENV_ARCH_LIST)!r} has no entry for GPU {index} "
            f"(compute capability {major}.{minor}, {torch.cuda.get_device_name(index)}); "
            f"an architecture-specific kernel runs only on its own compute capability"
        )
    return arch_for_capability(major, minor)


# ---------------------------------------------------------------------------------------------
# Directories
# ---------------------------------------------------------------------------------------------


def cache_root() -> Path:
    raw = os.environ.get(ENV_CACHE_DIR, "").strip()
    root = Path(raw).expanduser() if raw else Path.home() / ".cache" / "flashinfer_h3"
    return root.absolute()


def cache_dir(arch: str) -> Path:
    """``<root>/<version>/<arch>``: a new version or arch starts from an empty directory."""
    return cache_root() / __version__ / arch


def templates_dir() -> Path:
    """The Jinja templates: ``flashinfer_h3/templates`` in an installed package, else (a source
    checkout on ``PYTHONPATH``) the repository's top-level ``templates/``."""
    package_dir = Path(__file__).resolve().parent.parent
    candidates = [package_dir / "templates", package_dir.parent / "templates"]
    try:  # an editable install maps flashinfer_h3.templates onto the repository's templates/
        import importlib.util

        spec = importlib.util.find_spec("flashinfer_h3.templates")
        if spec is not None and spec.submodule_search_locations:
            candidates[1:1] = [Path(p) for p in spec.submodule_search_locations]
    except (ImportError, ValueError):
        pass
    for cand in candidates:
        if (cand / "include").is_dir():
            return cand
    raise TemplateNotFoundError(
        "flashinfer_h3 cannot find its kernel templates; looked in "
        + ", ".join(str(c) for c in candidates)
        + ". Reinstall the package (the templates ship as package data)."
    )


def include_dir() -> Path:
    return templates_dir() / "include"


def _tvm_ffi_package_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def tvm_ffi_include_dirs() -> list[Path]:
    """tvm-ffi's C++ headers (dlpack included). Located without importing tvm_ffi, whose import
    pulls in torch: ``warmup`` and the cache-key computation stay fast."""
    pkg = _tvm_ffi_package_dir()
    if pkg is not None and (pkg / "include" / "tvm" / "ffi").is_dir():
        dirs = [pkg / "include"]
        if not (pkg / "include" / "dlpack").is_dir():
            import tvm_ffi.libinfo

            dirs.append(Path(tvm_ffi.libinfo.find_dlpack_include_path()))
        return dirs
    import tvm_ffi.libinfo

    dirs = [Path(tvm_ffi.libinfo.find_include_path())]
    dlpack = Path(tvm_ffi.libinfo.find_dlpack_include_path())
    if dlpack not in dirs:
        dirs.append(dlpack)
    return dirs


@functools.lru_cache(maxsize=1)
def tvm_ffi_version() -> str:
    """The installed apache-tvm-ffi version (part of the cache key: its headers are the ABI)."""
    from importlib import metadata

    try:
        return metadata.version("apache-tvm-ffi")
    except metadata.PackageNotFoundError:
        import tvm_ffi

        return str(tvm_ffi.__version__)


# ---------------------------------------------------------------------------------------------
# Toolchain
# ---------------------------------------------------------------------------------------------


def find_nvcc() -> Path | None:
    """The nvcc to use, or None. Order: FLASHINFER_H3_NVCC, CUDA_HOME/CUDA_PATH, PATH, the
    conventional install directory."""
    explicit = os.environ.get(ENV_NVCC, "").strip()
    if explicit:
        path = Path(explicit)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var, "").strip()
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home) / "bin" / "nvcc"
    on_path = shutil.which("nvcc")
    if on_path:
        return Path(on_path)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.is_file() else None


@functools.lru_cache(maxsize=8)
def _nvcc_version_of(nvcc: str, mtime_ns: int) -> tuple[str, tuple[int, int]]:
    del mtime_ns  # part of the cache key only: a replaced nvcc is asked again
    try:
        out = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise MissingToolchainError(f"cannot run {nvcc} --version: {exc}") from exc
    m = re.search(r"release (\d+)\.(\d+)", out)
    if m is None:
        raise MissingToolchainError(
            f"cannot parse the CUDA release from `{nvcc} --version`: {out!r}"
        )
    # The last line names the exact build ("Build cuda_13.0.r13.0/compiler.36424714_0"): keyed in
    # full so that two nvcc builds of one release never share a cache entry.
    lines = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else m.group(0)), (int(m.group(1)), int(m.group(2)))


def nvcc_version(nvcc: Path) -> tuple[str, tuple[int, int]]:
    """``(full build string, (major, minor))`` of an nvcc, cached per binary."""
    return _nvcc_version_of(str(nvcc), nvcc.stat().st_mtime_ns)


def install_hint() -> str:
    return (
        "install the CUDA Toolkit 12.8 or newer (13.x recommended) and put its nvcc on PATH or "
        "set CUDA_HOME (or FLASHINFER_H3_NVCC), or install the prebuilt kernels "
        "(the flashinfer-h3-jit-cache wheel, or a directory named by FLASHINFER_H3_PREBUILT_DIR)"
    )


def require_nvcc(arch: str) -> tuple[Path, str]:
    """nvcc and its version string, checked to know ``arch``; else MissingToolchainError."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise MissingToolchainError(
            f"flashinfer_h3 must compile its {arch} kernels on first use but found no nvcc and no "
            f"prebuilt kernel; {install_hint()}"
        )
    full, release = nvcc_version(nvcc)
    need = ARCHS[arch].min_cuda
    if release < need:
        raise MissingToolchainError(
            f"{nvcc} is CUDA {release[0]}.{release[1]}, which cannot compile {arch} (needs CUDA "
            f"{need[0]}.{need[1]} or newer); {install_hint()}"
        )
    return nvcc, full


def extra_nvcc_flags() -> list[str]:
    return shlex.split(os.environ.get(ENV_NVCC_FLAGS, ""))


def jit_disabled() -> bool:
    return os.environ.get(ENV_DISABLE_JIT, "").strip().lower() in ("1", "true", "yes", "on")


def find_ninja() -> list[str]:
    """The ninja command: the pip package's binary (a declared dependency), else PATH."""
    try:
        import ninja

        exe = Path(ninja.BIN_DIR) / "ninja"
        if exe.is_file():
            return [str(exe)]
    except (ImportError, AttributeError):
        pass
    on_path = shutil.which("ninja")
    if on_path:
        return [on_path]
    raise MissingToolchainError("flashinfer_h3 needs ninja to build kernels: pip install ninja")
