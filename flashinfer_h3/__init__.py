"""flashinfer_h3: low-precision packed-varlen attention for MiniMax-H3 (NVFP4 and FP8)."""

from .version import __version__

__all__ = ["__version__"]
