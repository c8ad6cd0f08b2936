"""Prebuilt-kernel lookup.

Prebuilt kernels come from a directory holding ``manifest.json`` and the ``.so`` files it names:
``FLASHINFER_H3_PREBUILT_DIR`` first, then the ``flashinfer_h3_jit_cache`` package (the AOT wheel
of ``jit_cache/``); ``load.export_prebuilt`` writes such a directory. An entry is used only when
it was built from exactly the sources, headers and flags this installation would compile
(``source_key``), for the same flashinfer_h3 version and a tvm-ffi of the same minor series; its
SHA-256 is checked before loading. Anything else falls through to the JIT.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from ..version import __version__
from .env import ENV_PREBUILT_DIR, tvm_ffi_version
from .files import file_sha256, logger
from .spec import JitSpec

PREBUILT_PACKAGE = "flashinfer_h3_jit_cache"
PREBUILT_MANIFEST = "manifest.json"
PREBUILT_FORMAT = 1

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _minor_series(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def prebuilt_dirs() -> list[Path]:
    """Directories searched for prebuilt kernels, in order."""
    dirs: list[Path] = []
    explicit = os.environ.get(ENV_PREBUILT_DIR, "").strip()
    if explicit:
        dirs.append(Path(explicit).expanduser().absolute())
    try:
        pkg = importlib.import_module(PREBUILT_PACKAGE)
    except ImportError:
        pkg = None
    if pkg is not None:
        kernel_dir = getattr(pkg, "kernel_dir", None)
        if callable(kernel_dir):
            dirs.append(Path(kernel_dir()))
    return dirs


def read_prebuilt_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a prebuilt directory, or None (with a warning) when it is unusable."""
    path = directory / PREBUILT_MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _warn_once(f"ignoring prebuilt kernels in {directory}: unreadable manifest ({exc})")
        return None
    if not isinstance(data, dict) or data.get("format") != PREBUILT_FORMAT:
        _warn_once(f"ignoring prebuilt kernels in {directory}: unknown manifest format")
        return None
    if data.get("flashinfer_h3") != __version__:
        _warn_once(
            f"ignoring prebuilt kernels in {directory}: built for flashinfer_h3 "
            f"{data.get('flashinfer_h3')}, this is {__version__} (install the matching "
            "flashinfer-h3-jit-cache)"
        )
        return None
    return data


def list_prebuilt() -> list[tuple[Path, dict[str, Any]]]:
    """Every usable manifest entry as ``(.so path, entry)`` (``python -m flashinfer_h3 info``)."""
    found = []
    for directory in prebuilt_dirs():
        manifest = read_prebuilt_manifest(directory)
        for entry in (manifest or {}).get("kernels", []):
            found.append((directory / entry["file"], entry))
    return found


def find_prebuilt(spec: JitSpec) -> Path | None:
    cfg = spec.config
    for so, entry in list_prebuilt():
        if (
            entry.get("module") != cfg.module
            or entry.get("head_dim") != cfg.head_dim
            or entry.get("arch") != cfg.arch
            or entry.get("flags", {}) != dict(cfg.flags)
            or entry.get("source_key") != spec.source_key
        ):
            continue
        built_with = str(entry.get("tvm_ffi", ""))
        if _minor_series(built_with) != _minor_series(tvm_ffi_version()):
            _warn_once(
                f"ignoring prebuilt {so.name}: built against apache-tvm-ffi {built_with}, "
                f"installed {tvm_ffi_version()}"
            )
            continue
        if not so.is_file() or file_sha256(so) != entry.get("sha256"):
            _warn_once(f"ignoring prebuilt {so}: missing or its SHA-256 does not match")
            continue
        return so
    return None
