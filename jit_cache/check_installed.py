"""Check an installed flashinfer-h3-jit-cache wheel: every production module of the installed
flashinfer_h3, for each arch, is found in the wheel and loads, with the JIT disabled.

Usage (in the environment the wheels were installed into, from outside the checkout so that
``jit_cache/`` is not importable; ``-I`` keeps the script's folder off ``sys.path``):

    FLASHINFER_H3_DISABLE_JIT=1 python -I jit_cache/check_installed.py --arch sm_90a,sm_120a

Loading needs no GPU: the kernels link the CUDA runtime statically and it initialises on the
first launch, so ``tvm_ffi.load_module`` only maps the ``.so`` and binds its exports. Exits 1 when
a module is missing, is not taken from the wheel, or fails to load.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
from pathlib import Path


def production_modules() -> list[tuple[str, tuple[str, ...] | None]]:
    """(name, archs or None for all) of every production module of the installed package."""
    try:
        from flashinfer_h3.jit.modules import production_modules as registered
    except ImportError:  # a flashinfer_h3 from before jit/modules.py
        from flashinfer_h3.jit import OPS

        return [(name, None) for name in OPS]
    return [(m.name, tuple(m.archs)) for m in registered()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a,sm_120a", help="default: %(default)s")
    args = parser.parse_args(argv)

    import flashinfer_h3
    from flashinfer_h3.jit import KernelConfig, build_module, find_nvcc, load_so, parse_arch_list
    from flashinfer_h3.jit.spec import SUPPORTED_HEAD_DIMS

    pkg = importlib.import_module("flashinfer_h3_jit_cache")
    kernel_dir = Path(pkg.kernel_dir()).resolve()
    print(f"flashinfer_h3 {flashinfer_h3.__version__}: {Path(flashinfer_h3.__file__).parent}")
    print(f"flashinfer_h3_jit_cache {pkg.__version__}: {kernel_dir}")
    jit_off = os.environ.get("FLASHINFER_H3_DISABLE_JIT") == "1"
    nvcc = find_nvcc() or shutil.which("nvcc")
    print(f"FLASHINFER_H3_DISABLE_JIT={'1' if jit_off else 'unset'}; nvcc: {nvcc or 'not found'}")
    failures = 0
    if not jit_off:
        print("error: set FLASHINFER_H3_DISABLE_JIT=1 (a cache miss must not compile)")
        failures += 1
    count = 0
    for arch in parse_arch_list(args.arch):
        for name, archs in production_modules():
            if archs is not None and arch not in archs:
                continue
            for head_dim in SUPPORTED_HEAD_DIMS:
                count += 1
                label = f"{name} hd{head_dim} {arch}"
                try:
                    so = build_module(KernelConfig(name, head_dim, arch)).resolve()
                except Exception as exc:
                    print(f"  MISSING {label}: {type(exc).__name__}: {exc}")
                    failures += 1
                    continue
                if not so.is_relative_to(kernel_dir):
                    print(f"  NOT FROM THE WHEEL {label}: {so}")
                    failures += 1
                    continue
                try:
                    module = load_so(so)
                    info = getattr(module, "build_info", None)
                    detail = f" ({info()})" if callable(info) else ""
                except Exception as exc:
                    print(f"  FOUND, LOAD FAILED {label}: {so.name}: {exc}")
                    failures += 1
                    continue
                print(f"  found and loaded {label}: {so.relative_to(kernel_dir)}{detail}")
    print(f"check_installed: {count - failures if failures <= count else 0}/{count} module(s) "
          f"found and loaded" + ("" if not failures else f", {failures} problem(s)"))
    return 1 if failures or count == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
