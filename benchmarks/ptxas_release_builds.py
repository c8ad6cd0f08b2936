"""The production Hopper kernels assembled by another CUDA release's ptxas, for a timing.

Usage::

    pip install --no-deps --target /tmp/cu126 nvidia-cuda-nvcc-cu12==12.6.85
    python benchmarks/ptxas_release_builds.py --ptxas /tmp/cu126/nvidia/cuda_nvcc/bin/ptxas \\
        --out .h3ptxas/126
    # then, on the GPU (kernel alone, production of the default toolchain against these):
    python benchmarks/bench_wgmma_variants.py --op nvfp4 --preset h3-mix,h3-10s --only none \\
        --so nvfp4=.h3ptxas/126/nvfp4.so

ptxas makes the schedule, and the schedule alone has moved these kernels by 0.6-5 % whenever a
change outside the tile loop made ptxas reorder it (benchmarks/RESULTS.md, thirty-fourth
session). FlashAttention-3 names the CUDA release it is fastest with for the same reason. This
builds the `fp8_wgmma` and `nvfp4_wgmma` modules with nvcc's own front end (the same PTX) and
the given ptxas, copies their .so to ``--out`` as ``fp8.so`` and ``nvfp4.so`` (what
``bench_wgmma_variants.py --so`` loads), and compares each consumer tile loop with the default
toolchain's build (``sass_tile_loop.py``: the same loop renamed, or a new schedule to time).

How: a shim toolkit in a temporary directory, links to nvcc's own except ``bin/nvcc`` (a copy,
since nvcc finds its tools next to its real path) and ``bin/ptxas``, a script that lowers the
PTX's ``.version`` line to what the release reads (``--isa``; by default the release's own,
``ISA_OF_RELEASE``) and runs the given ptxas. The build fails loudly if the PTX uses something
newer than that ISA. The JIT cache key names nvcc's release, not ptxas's, so the shim's builds
go to a cache directory of their own, never the user's. Needs nvcc and cuobjdump; no GPU.

Measured (benchmarks/RESULTS.md, thirty-sixth session, H100, kernel alone): ptxas 12.6 and 12.4
0-8 % slower than 13.0's, outputs bit for bit the same; production stays on the toolkit's ptxas.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from flashinfer_h3.benchtools import HOPPER_MODULES  # op -> (module, backend)
from flashinfer_h3.jit import find_nvcc

# The PTX ISA version each CUDA release's ptxas reads at most (PTX ISA release notes).
ISA_OF_RELEASE = {(12, 4): "8.4", (12, 5): "8.5", (12, 6): "8.5", (12, 8): "8.7", (12, 9): "8.8",
                  (13, 0): "9.0"}
_SHIM_PTXAS = """#!/bin/bash
# ptxas of another CUDA release on nvcc's PTX, its .version line lowered to {isa}
# (benchmarks/ptxas_release_builds.py).
echo "ptxas shim: {ptxas} (PTX ISA {isa})" >&2
args=()
for a in "$@"; do
  if [[ $a == *.ptx && -f $a ]]; then
    t=$(mktemp -p "{scratch}" --suffix=.ptx) || exit 1
    sed -e 's/^\\.version [0-9.]*/.version {isa}/' "$a" > "$t" || exit 1
    args+=("$t")
  else
    args+=("$a")
  fi
done
exec "{ptxas}" "${{args[@]}}"
"""


def release_of(ptxas: Path) -> tuple[int, int]:
    text = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True,
                          check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", text)
    if not m:
        raise SystemExit(f"--ptxas: {ptxas} --version names no release:\n{text}")
    return int(m.group(1)), int(m.group(2))


def nvcc_bin_dir(nvcc: str) -> Path:
    """The directory of nvcc's real binary (its ``_HERE_``; nvcc on PATH may be a wrapper)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "empty.cu"
        src.write_text("__global__ void empty_kernel() {}\n")
        text = subprocess.run([nvcc, "--dryrun", "-c", str(src)], capture_output=True, text=True,
                              check=True).stderr
    m = re.search(r"^#\$ _HERE_=(.+)$", text, re.M)
    if not m:
        raise SystemExit(f"{nvcc} --dryrun names no _HERE_ directory")
    return Path(m.group(1).strip())


def make_shim(root: Path, bin_dir: Path, ptxas: Path, isa: str) -> Path:
    """A toolkit at ``root`` that is nvcc's except for ptxas; returns its nvcc."""
    top = bin_dir.parent
    for entry in top.iterdir():
        if entry.name != "bin":
            (root / entry.name).symlink_to(entry)
    (root / "bin").mkdir()
    for entry in bin_dir.iterdir():
        if entry.name == "nvcc":
            shutil.copy2(entry, root / "bin" / "nvcc")
        elif entry.name != "ptxas":
            (root / "bin" / entry.name).symlink_to(entry)
    shim = root / "bin" / "ptxas"
    # The lowered PTX files go to root/scratch, removed with the shim.
    (root / "scratch").mkdir()
    shim.write_text(_SHIM_PTXAS.format(ptxas=ptxas, isa=isa, scratch=root / "scratch"))
    shim.chmod(0o755)
    return root / "bin" / "nvcc"


def build_paths(env: dict[str, str]) -> dict[str, Path]:
    """The production .so of each Hopper module under ``env`` (a subprocess, so that the JIT
    reads that environment's nvcc and cache)."""
    code = ("from flashinfer_h3.jit import KernelConfig, build_module\n"
            + "".join(f"print({op!r}, build_module(KernelConfig({mod!r}, arch='sm_90a'), "
                      f"use_prebuilt=False))\n" for op, (mod, _) in HOPPER_MODULES.items()))
    text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if text.returncode != 0:
        raise SystemExit(f"build failed:\n{text.stderr[-4000:]}")
    paths = {}
    for line in text.stdout.splitlines():
        op, _, path = line.partition(" ")
        paths[op] = Path(path)
    return paths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptxas", type=Path, required=True, help="the other release's ptxas binary")
    ap.add_argument("--out", type=Path, required=True, help="where fp8.so and nvfp4.so go")
    ap.add_argument("--isa", help="the PTX ISA version to declare (default: the release's)")
    ap.add_argument("--nvcc", type=Path, default=find_nvcc(),
                    help="the nvcc whose front end makes the PTX (default: the JIT's)")
    args = ap.parse_args()
    if args.nvcc is None:
        ap.error("--nvcc: no nvcc found (FLASHINFER_H3_NVCC, CUDA_HOME, PATH); give one")
    if not args.ptxas.is_file():
        ap.error(f"--ptxas: expected a ptxas binary, {args.ptxas} is not a file")
    release = release_of(args.ptxas)
    isa = args.isa or ISA_OF_RELEASE.get(release)
    if isa is None:
        ap.error(f"--isa: ptxas of CUDA {release[0]}.{release[1]} has no known PTX ISA; give it")
    bin_dir = nvcc_bin_dir(str(args.nvcc))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sass_tile_loop import compare
    with tempfile.TemporaryDirectory(prefix="ptxas_release_") as tmp:
        root, cache = Path(tmp) / "toolkit", Path(tmp) / "cache"
        root.mkdir()
        nvcc = make_shim(root, bin_dir, args.ptxas.resolve(), isa)
        print(f"ptxas of CUDA {release[0]}.{release[1]} (PTX ISA {isa}) behind {bin_dir}/nvcc's "
              f"front end; building the Hopper modules into {cache}", flush=True)
        env = dict(os.environ, FLASHINFER_H3_NVCC=str(nvcc), FLASHINFER_H3_CACHE_DIR=str(cache))
        env.pop("FLASHINFER_H3_DISABLE_JIT", None)
        built = build_paths(env)
        baseline = build_paths(dict(os.environ, FLASHINFER_H3_NVCC=str(args.nvcc)))
        args.out.mkdir(parents=True, exist_ok=True)
        for op, (module, _) in HOPPER_MODULES.items():
            log = (built[op].parent / "build.log").read_text()
            if "ptxas shim:" not in log:
                raise SystemExit(f"{op}: the build did not go through the shim:\n{log[-400:]}")
            target = args.out / f"{op}.so"
            shutil.copy2(built[op], target)
            print(f"\n{op}: {target} against {baseline[op]}", flush=True)
            compare(baseline[op], target, f"attention_{module}_kernel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
