"""Build one module: prebuilt lookup, JIT cache lookup, then render + ninja + nvcc under a lock.

Cache entry of a module (``<cache root>/<version>/<arch>/<uri>/``)::

    utils.cu ...        the rendered sources (kept for debugging and for ninja's dependency scan)
    build.ninja         the build, runnable by hand: ``ninja -C <dir>``
    build.log           nvcc / ptxas output of the last build (``-Xptxas -v`` register report)
    <uri>.so            the module
    manifest.json       written last, holds the .so's SHA-256: a .so without a matching manifest
                        (a crashed or interrupted build, a truncated copy) is rebuilt, never loaded

``<cache root>/<version>/<arch>/<uri>.lock`` serialises builds of one URI across processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import filelock

from ..version import __version__
from .env import (
    ENV_DISABLE_JIT,
    JitBuildError,
    MissingJitCacheError,
    cache_dir,
    find_ninja,
    find_nvcc,
    include_dir,
    install_hint,
    jit_disabled,
    nvcc_version,
    require_nvcc,
    tvm_ffi_include_dirs,
)
from .spec import JitSpec, KernelConfig, make_spec

logger = logging.getLogger("flashinfer_h3.jit")

MANIFEST = "manifest.json"
BUILD_LOG = "build.log"
LOG_TAIL_LINES = 60
_ELF_MAGIC = b"\x7fELF"
_BUILD_OUTPUT_SUFFIXES = (".o", ".d", ".so")
_NINJA_STATE = (".ninja_log", ".ninja_deps")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (not at import), so
    redirections by the application or the test runner are honoured."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _setup_logger() -> None:
    # A library logger with its own handler: the compile line must reach a user who never
    # configured logging, and a minute of silence looks like a hang. FLASHINFER_H3_LOG_LEVEL
    # (e.g. WARNING) silences it.
    if logger.handlers:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("flashinfer_h3: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("FLASHINFER_H3_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


_setup_logger()


# ---------------------------------------------------------------------------------------------
# Validity of a built module
# ---------------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(build_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((build_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def valid_so(so_path: Path, manifest: dict[str, Any] | None) -> bool:
    """True when ``so_path`` is a complete ELF file whose size and SHA-256 match the manifest."""
    if manifest is None or manifest.get("so") != so_path.name:
        return False
    try:
        if so_path.stat().st_size != manifest.get("size"):
            return False
        with open(so_path, "rb") as f:
            if f.read(4) != _ELF_MAGIC:
                return False
        return file_sha256(so_path) == manifest.get("sha256")
    except OSError:
        return False


def _cached_so(build_dir: Path, uri: str) -> Path | None:
    so = build_dir / f"{uri}.so"
    return so if valid_so(so, read_manifest(build_dir)) else None


def _find_cached_any_toolchain(spec: JitSpec) -> Path | None:
    """Without nvcc the URI cannot be computed; accept a cache entry of any nvcc whose sources,
    flags and tvm-ffi version match (e.g. a cache filled by ``warmup`` on a build machine)."""
    root = cache_dir(spec.config.arch)
    if not root.is_dir():
        return None
    best: tuple[float, Path] | None = None
    for entry in root.glob(f"{spec.config.name}_*"):
        manifest = read_manifest(entry)
        if (
            manifest is None
            or manifest.get("source_key") != spec.source_key
            or manifest.get("tvm_ffi") != spec.tvm_ffi_version
        ):
            continue
        so = entry / str(manifest.get("so", ""))
        if valid_so(so, manifest):
            mtime = so.stat().st_mtime
            if best is None or mtime > best[0]:
                best = (mtime, so)
    return best[1] if best else None


# ---------------------------------------------------------------------------------------------
# ninja
# ---------------------------------------------------------------------------------------------


def _ninja_path(p: Path | str) -> str:
    """Escape a path for a ninja build line (``$``, space and ``:`` are special there)."""
    return str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _ninja_value(words: list[str]) -> str:
    """A shell-quoted command fragment, escaped for a ninja variable."""
    return " ".join(shlex.quote(w) for w in words).replace("$", "$$")


def object_name(source: str) -> str:
    return Path(source).stem + ".o"


def generate_ninja(spec: JitSpec, build_dir: Path, nvcc: Path, uri: str) -> str:
    """The build.ninja of one module: each rendered source compiled separately (header
    dependencies tracked through nvcc's depfiles), then linked into ``<uri>.so``."""
    includes = ["-I", str(include_dir())]
    for d in tvm_ffi_include_dirs():
        includes += ["-isystem", str(d)]
    objects = [build_dir / object_name(name) for name, _ in spec.sources]
    lines = [
        "# Generated by flashinfer_h3.jit; rebuild by hand with: ninja -v -C <this directory>",
        "ninja_required_version = 1.3",
        f"nvcc = {_ninja_value([str(nvcc)])}",
        f"cuda_flags = {_ninja_value(list(spec.cuda_flags) + includes)}",
        f"ld_flags = {_ninja_value(list(spec.ld_flags))}",
        "",
        "rule cuda_compile",
        "  command = $nvcc --generate-dependencies-with-compile --dependency-output $out.d "
        "$cuda_flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $in",
        "",
        "rule link",
        "  command = $nvcc $ld_flags $in -o $out",
        "  description = link $out",
        "",
    ]
    for (name, _), obj in zip(spec.sources, objects, strict=True):
        lines.append(f"build {_ninja_path(obj)}: cuda_compile {_ninja_path(build_dir / name)}")
    so = build_dir / f"{uri}.so"
    lines.append(f"build {_ninja_path(so)}: link {' '.join(_ninja_path(o) for o in objects)}")
    lines.append(f"default {_ninja_path(so)}")
    return "\n".join(lines) + "\n"


def write_if_different(path: Path, text: str) -> None:
    """Keep the old mtime when nothing changed (ninja decides staleness by mtimes)."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return "(no build log)"
    return "\n".join(text[-lines:])


def _clean_outputs(build_dir: Path) -> None:
    """Remove every output of an earlier attempt: a .so or object left by a killed build may be
    newer than its sources, and ninja would then take it as up to date."""
    for entry in build_dir.iterdir():
        if (
            entry.name == MANIFEST
            or entry.name in _NINJA_STATE
            or entry.suffix in _BUILD_OUTPUT_SUFFIXES
        ) and entry.is_file():
            entry.unlink()


def _run_ninja(build_dir: Path, log: Path) -> int:
    cmd = find_ninja() + ["-v", "-C", str(build_dir), "-f", "build.ninja"]
    jobs = os.environ.get("MAX_JOBS", "").strip()
    if jobs:
        cmd += ["-j", jobs]
    with open(log, "w") as f:
        f.write(f"# {datetime.now(timezone.utc).isoformat()} {shlex.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def _compile(spec: JitSpec, nvcc: Path, nvcc_full: str, uri: str, build_dir: Path) -> Path:
    build_dir.mkdir(parents=True, exist_ok=True)
    _clean_outputs(build_dir)
    for name, text in spec.sources:
        write_if_different(build_dir / name, text)
    write_if_different(build_dir / "build.ninja", generate_ninja(spec, build_dir, nvcc, uri))
    log = build_dir / BUILD_LOG
    cfg = spec.config
    logger.info(
        "compiling %s kernels for %s (first use of this configuration, can take a minute) -> %s",
        cfg.op,
        cfg.arch,
        build_dir,
    )
    start = time.perf_counter()
    rc = _run_ninja(build_dir, log)
    seconds = time.perf_counter() - start
    so = build_dir / f"{uri}.so"
    if rc != 0:
        raise JitBuildError(
            f"compiling flashinfer_h3 module {uri} failed (ninja exit code {rc}); full build log: "
            f"{log}\n--- last lines of the build log ---\n{_log_tail(log)}"
        )
    try:
        with open(so, "rb") as f:
            ok = f.read(4) == _ELF_MAGIC
    except OSError:
        ok = False
    if not ok:
        raise JitBuildError(
            f"ninja succeeded but {so} is missing or not an ELF shared object; build log: {log}\n"
            f"{_log_tail(log)}"
        )
    manifest = {
        "uri": uri,
        "so": so.name,
        "size": so.stat().st_size,
        "sha256": file_sha256(so),
        "source_key": spec.source_key,
        "config": cfg.describe(),
        "nvcc": nvcc_full,
        "tvm_ffi": spec.tvm_ffi_version,
        "flashinfer_h3": __version__,
        "cuda_flags": list(spec.cuda_flags),
        "build_seconds": round(seconds, 3),
        "built_at": datetime.now(timezone.utc).isoformat(),
    }
    write_if_different(build_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    logger.info("compiled %s for %s in %.1f s (%s)", cfg.op, cfg.arch, seconds, uri)
    return so


def build_module(
    config: KernelConfig, *, use_prebuilt: bool = True, template_dir: Path | None = None
) -> Path:
    """Path of a valid ``.so`` for ``config``: prebuilt, cached, or compiled now (no GPU needed).

    Order: a prebuilt kernel (``use_prebuilt``), the JIT cache, then a compile under a per-URI
    file lock (another process building the same URI is waited for, not duplicated). Raises
    :class:`MissingJitCacheError` on a miss with ``FLASHINFER_H3_DISABLE_JIT=1``,
    :class:`MissingToolchainError` without nvcc, :class:`JitBuildError` when nvcc fails.
    """
    spec = make_spec(config, template_dir)
    if use_prebuilt:
        from .load import find_prebuilt

        prebuilt = find_prebuilt(spec)
        if prebuilt is not None:
            return prebuilt

    nvcc = find_nvcc()
    if nvcc is None:
        cached = _find_cached_any_toolchain(spec)
        if cached is not None:
            return cached
    else:
        nvcc_full, _ = nvcc_version(nvcc)
        uri = spec.uri(nvcc_full)
        cached = _cached_so(spec.build_dir(nvcc_full), uri)
        if cached is not None:
            return cached

    if jit_disabled():
        raise MissingJitCacheError(
            f"{ENV_DISABLE_JIT}=1 and no prebuilt or cached kernel matches {config.name} "
            f"(cache: {cache_dir(config.arch)}); build it with `python -m flashinfer_h3 warmup "
            f"--arch {config.arch}` where JIT is allowed, or install the prebuilt kernels"
        )
    nvcc, nvcc_full = require_nvcc(config.arch)
    uri = spec.uri(nvcc_full)
    build_dir = spec.build_dir(nvcc_full)
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(build_dir.parent / f"{uri}.lock"), thread_local=False)
    try:
        lock.acquire(timeout=0.2)
    except filelock.Timeout:
        logger.info("waiting for another process that is building %s", uri)
        lock.acquire()
    try:
        cached = _cached_so(build_dir, uri)  # built by the process we waited for
        if cached is not None:
            return cached
        return _compile(spec, nvcc, nvcc_full, uri, build_dir)
    finally:
        lock.release()


__all__ = [
    "build_module",
    "generate_ninja",
    "install_hint",
    "read_manifest",
    "valid_so",
]
