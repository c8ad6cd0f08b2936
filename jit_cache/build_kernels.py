"""Fill jit_cache/flashinfer_h3_jit_cache/kernels/ with every kernel module of flashinfer_h3.

Usage: python jit_cache/build_kernels.py [--arch sm_90a,sm_120a] [--op utils,nvfp4,fp8]

The modules come from the JIT's module registry (flashinfer_h3.jit.modules: every
production module, for each arch it supports), so a new module is shipped without editing this
file. Needs nvcc and flashinfer_h3 importable, no GPU; modules already in the JIT cache
(FLASHINFER_H3_CACHE_DIR) are copied, not rebuilt. kernels/ is replaced as a whole (no stale .so).
Then: pip wheel --no-deps -w dist ./jit_cache
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

from flashinfer_h3 import __version__
from flashinfer_h3.jit import KernelConfig, export_prebuilt, parse_arch_list
from flashinfer_h3.jit.spec import SUPPORTED_HEAD_DIMS

HERE = Path(__file__).resolve().parent


def jit_cache_package() -> ModuleType:
    """This checkout's flashinfer_h3_jit_cache/__init__.py, loaded under a private name: neither
    sys.path nor sys.modules changes, so this checkout's kernels never become the installed
    prebuilt package of the process (the tests load this file)."""
    spec = importlib.util.spec_from_file_location(
        "_flashinfer_h3_jit_cache_of_the_checkout", HERE / "flashinfer_h3_jit_cache" / "__init__.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def production_modules() -> list[tuple[str, tuple[str, ...] | None]]:
    """(module name, archs it is built for or None for all) of every production module, from
    the JIT's module registry: a module registered there is shipped without editing this file."""
    try:
        from flashinfer_h3.jit.modules import production_modules as registered
    except ImportError:  # a flashinfer_h3 from before jit/modules.py: every op of OPS
        from flashinfer_h3.jit import OPS

        return [(name, None) for name in OPS]
    return [(m.name, tuple(m.archs)) for m in registered()]


def module_configs(archs: list[str], only: list[str] | None = None) -> list[KernelConfig]:
    """Every production module (or those named in ``only``) for each arch it supports."""
    modules = production_modules()
    if only is not None:
        known = {name for name, _ in modules}
        unknown = [name for name in only if name not in known]
        if unknown:
            raise SystemExit(
                f"build_kernels --op: unknown module(s) {', '.join(unknown)}; expected "
                f"{', '.join(sorted(known))}"
            )
    return [
        KernelConfig(name, head_dim, arch)
        for arch in archs
        for name, supported in modules
        if (only is None or name in only) and (supported is None or arch in supported)
        for head_dim in SUPPORTED_HEAD_DIMS
    ]


def main(argv: list[str] | None = None) -> int:
    flashinfer_h3_jit_cache = jit_cache_package()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", default="sm_90a,sm_120a", help="comma-separated targets (default: %(default)s)"
    )
    parser.add_argument(
        "--op", help="comma-separated modules (default: every production module)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=flashinfer_h3_jit_cache.kernel_dir(),
        help="output directory (default: the package's kernels/)",
    )
    args = parser.parse_args(argv)
    if flashinfer_h3_jit_cache.__version__ != __version__:
        print(
            f"flashinfer_h3_jit_cache {flashinfer_h3_jit_cache.__version__} != flashinfer_h3 "
            f"{__version__}: bump jit_cache/flashinfer_h3_jit_cache/__init__.py first",
            file=sys.stderr,
        )
        return 1
    ops = [o.strip() for o in args.op.split(",") if o.strip()] if args.op else None
    configs = module_configs(parse_arch_list(args.arch), ops)
    if not configs:
        print("build_kernels: no module to build", file=sys.stderr)
        return 1
    print(f"build_kernels: {len(configs)} module(s): " + ", ".join(c.name for c in configs))
    out: Path = args.out
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    start = time.perf_counter()
    export_prebuilt(configs, staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(
        f"build_kernels: wrote {len(configs)} kernel(s) to {out} in "
        f"{time.perf_counter() - start:.1f} s; manifest {out / 'manifest.json'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
