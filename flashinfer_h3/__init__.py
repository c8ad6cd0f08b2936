"""flashinfer_h3: low-precision packed-varlen attention for MiniMax-H3 (NVFP4 and FP8).

The operators live in :mod:`flashinfer_h3.diffusion_ops` and are re-exported here lazily, so
that ``import flashinfer_h3.jit`` (the CLI, the build tests) does not import torch. The backend
choice (``set_backend``, ``use_backend``; see :mod:`flashinfer_h3.backends`) is re-exported too.
"""

from typing import Any

from .version import __version__

_OPS_EXPORTS = (
    "minimax_h3_sm120_varlen_attention_fp8",
    "minimax_h3_sm120_varlen_attention_nvfp4",
    "varlen_attention_fp8",
    "varlen_attention_nvfp4",
    "workspace_bytes_fp8",
    "workspace_bytes_nvfp4",
)

_BACKEND_EXPORTS = ("set_backend", "use_backend")

__all__ = ["__version__", "diffusion_ops", *_OPS_EXPORTS, *_BACKEND_EXPORTS]


def __getattr__(name: str) -> Any:
    import importlib

    if name == "diffusion_ops" or name in _OPS_EXPORTS:
        ops = importlib.import_module(".diffusion_ops", __name__)
        return ops if name == "diffusion_ops" else getattr(ops, name)
    if name in _BACKEND_EXPORTS:
        return getattr(importlib.import_module(".backends", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
