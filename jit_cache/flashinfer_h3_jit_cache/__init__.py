"""Prebuilt flashinfer_h3 kernels: ``kernels/manifest.json`` and the ``.so`` files it lists.

flashinfer_h3.jit imports this package, calls :func:`kernel_dir` and loads a listed kernel when
its configuration, source key, flashinfer_h3 version and tvm-ffi series match the installation.
"""

from pathlib import Path

# Must equal flashinfer_h3.__version__ (tests/jit/test_packaging.py checks it).
__version__ = "0.1.0"


def kernel_dir() -> Path:
    """The directory holding ``manifest.json`` and ``<arch>/<module>.so``."""
    return Path(__file__).resolve().parent / "kernels"
