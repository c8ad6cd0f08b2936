"""Fill jit_cache/flashinfer_h3_jit_cache/kernels/ with every module of flashinfer_h3.

Usage: python jit_cache/build_kernels.py [--arch sm_90a,sm_120a] [--op utils,nvfp4,fp8]
Needs nvcc and flashinfer_h3 importable; no GPU. Then ``pip wheel --no-deps ./jit_cache``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import flashinfer_h3_jit_cache  # noqa: E402

from flashinfer_h3 import __version__  # noqa: E402
from flashinfer_h3.jit import OPS, KernelConfig, export_prebuilt, parse_arch_list  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a,sm_120a")
    parser.add_argument("--op", default=",".join(OPS))
    args = parser.parse_args()
    if flashinfer_h3_jit_cache.__version__ != __version__:
        print(
            f"flashinfer_h3_jit_cache {flashinfer_h3_jit_cache.__version__} != flashinfer_h3 "
            f"{__version__}: bump jit_cache/flashinfer_h3_jit_cache/__init__.py first",
            file=sys.stderr,
        )
        return 1
    configs = [
        KernelConfig(op, 128, arch)
        for arch in parse_arch_list(args.arch)
        for op in args.op.split(",")
    ]
    manifest = export_prebuilt(configs, flashinfer_h3_jit_cache.kernel_dir())
    print(f"wrote {len(configs)} kernel(s); manifest {manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
