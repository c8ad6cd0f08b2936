"""The flashinfer-h3-jit-cache wheel: platform-tagged, pinned to one flashinfer-h3, never empty.

- Tag ``py3-none-<platform>`` (e.g. ``linux_x86_64``): the ``.so`` files are x86-64 Linux
  binaries; they do not depend on the Python ABI (tvm-ffi, no CPython or torch symbols).
- Requires ``flashinfer-h3==<its own version>``: the loader ignores kernels of another version.
- Refuses to build unless ``flashinfer_h3_jit_cache/kernels/manifest.json`` lists at least one
  kernel, every listed ``.so`` is present with its recorded SHA-256, and no unlisted ``.so``
  lies there (run ``python jit_cache/build_kernels.py`` first).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "flashinfer_h3_jit_cache"
KERNELS = PACKAGE / "kernels"
BUILD_HINT = "run `python jit_cache/build_kernels.py --arch sm_90a,sm_120a` first"


def package_version() -> str:
    match = re.search(r'^__version__ = "([^"]+)"', (PACKAGE / "__init__.py").read_text(), re.M)
    if match is None:
        raise SystemExit("jit_cache: no __version__ in flashinfer_h3_jit_cache/__init__.py")
    return match.group(1)


def check_kernels(version: str) -> list[dict]:
    """The manifest's kernels, or SystemExit saying why the wheel would be empty or wrong."""
    manifest = KERNELS / "manifest.json"
    if not manifest.is_file():
        raise SystemExit(
            f"jit_cache: refusing to build an empty wheel: no {manifest}; {BUILD_HINT}"
        )
    data = json.loads(manifest.read_text())
    kernels = data.get("kernels") or []
    if not kernels:
        raise SystemExit(f"jit_cache: refusing to build an empty wheel: {manifest} lists no kernel")
    if data.get("flashinfer_h3") != version:
        raise SystemExit(
            f"jit_cache: the kernels were built for flashinfer_h3 {data.get('flashinfer_h3')}, "
            f"this wheel is {version}; {BUILD_HINT}"
        )
    listed = set()
    for entry in kernels:
        so = KERNELS / entry["file"]
        if not so.is_file():
            raise SystemExit(f"jit_cache: {so} is listed in the manifest but missing; {BUILD_HINT}")
        if hashlib.sha256(so.read_bytes()).hexdigest() != entry.get("sha256"):
            raise SystemExit(f"jit_cache: {so} does not match its SHA-256; {BUILD_HINT}")
        listed.add(so.resolve())
    stale = sorted(str(p) for p in KERNELS.rglob("*.so") if p.resolve() not in listed)
    if stale:
        raise SystemExit(f"jit_cache: unlisted (stale) kernels {', '.join(stale)}; {BUILD_HINT}")
    return kernels


class BuildPy(build_py):
    def run(self) -> None:
        kernels = check_kernels(package_version())
        # A build/ left by an earlier wheel may hold kernels that are gone now.
        shutil.rmtree(Path(self.build_lib) / "flashinfer_h3_jit_cache" / "kernels", True)
        super().run()
        print(f"jit_cache: packaging {len(kernels)} kernel(s)")


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True  # binaries inside: a platform wheel, installed to platlib


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat

    def run(self) -> None:
        check_kernels(package_version())
        super().run()


VERSION = package_version()
setup(
    install_requires=[f"flashinfer-h3=={VERSION}"],
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPy, "bdist_wheel": PlatformWheel},
)
