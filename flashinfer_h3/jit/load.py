"""Module loading (tvm-ffi), the per-process module cache and the export of prebuilt kernels
(the lookup itself is ``prebuilt.py``)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import HEAD_DIM
from ..version import __version__
from .build import build_module, read_manifest
from .env import JitError, detect_arch
from .files import file_sha256
from .prebuilt import (  # noqa: F401  (re-exported: the lookup lived here)
    PREBUILT_FORMAT,
    PREBUILT_MANIFEST,
    PREBUILT_PACKAGE,
    _warned,
    find_prebuilt,
    list_prebuilt,
    prebuilt_dirs,
    read_prebuilt_manifest,
)
from .spec import KernelConfig

if TYPE_CHECKING:
    import torch


def export_prebuilt(configs: list[KernelConfig], out_dir: Path) -> Path:
    """Build (or reuse) each configuration and copy it into a prebuilt directory with its
    manifest; returns the manifest path. Used by the jit_cache wheel build and the tests."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = []
    for cfg in configs:
        so = build_module(cfg, use_prebuilt=False)
        meta = read_manifest(so.parent) or {}
        rel = Path(cfg.arch) / so.name
        (out_dir / cfg.arch).mkdir(exist_ok=True)
        shutil.copyfile(so, out_dir / rel)
        kernels.append(
            {
                **cfg.describe(),
                "file": rel.as_posix(),
                "sha256": file_sha256(out_dir / rel),
                "source_key": meta.get("source_key"),
                "tvm_ffi": meta.get("tvm_ffi"),
                "nvcc": meta.get("nvcc"),
            }
        )
    manifest = {"format": PREBUILT_FORMAT, "flashinfer_h3": __version__, "kernels": kernels}
    path = out_dir / PREBUILT_MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def load_so(path: Path) -> Any:
    """``tvm_ffi.load_module``, with a message that says which file failed and what to do."""
    import tvm_ffi

    try:
        return tvm_ffi.load_module(str(path))
    except Exception as exc:  # tvm-ffi raises RuntimeError/OSError variants for dlopen failures
        raise JitError(
            f"cannot load flashinfer_h3 kernel module {path}: {exc}. Delete its directory "
            f"({path.parent}) to force a rebuild."
        ) from exc


_MODULES: dict[tuple[str, int, str], Any] = {}
_MODULES_LOCK = threading.Lock()


def get_module(
    module: str, device: torch.device | int | str | None = None, *, head_dim: int = HEAD_DIM
) -> Any:
    """The loaded tvm-ffi module ``module`` (a name of ``jit/modules.py``) for ``device``
    (default: the current CUDA device).

    The arch comes from the device or ``FLASHINFER_H3_CUDA_ARCH_LIST``; the module is a prebuilt
    kernel when one matches, else a cached or freshly compiled JIT build. Loaded once per
    ``(module, head_dim, arch)`` per process.
    """
    arch = detect_arch(device)
    key = (module, head_dim, arch)
    loaded = _MODULES.get(key)
    if loaded is not None:
        return loaded
    with _MODULES_LOCK:
        loaded = _MODULES.get(key)
        if loaded is None:
            loaded = load_so(build_module(KernelConfig(module, head_dim, arch)))
            _MODULES[key] = loaded
    return loaded


def clear_module_cache() -> None:
    """Forget the loaded modules (tests; the .so files stay mapped until process exit)."""
    with _MODULES_LOCK:
        _MODULES.clear()
