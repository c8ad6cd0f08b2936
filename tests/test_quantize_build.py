"""CPU tests of the quantization pre-pass template (templates/quantize.cu.jinja + quantize.cuh).

The template renders for both ops, compiles with nvcc for sm_90a and sm_120a with the JIT's own
flags, every kernel fits its budget (no stack frame, no spills, the tile kernel within the 80
registers of 3 CTAs an SM), sm_120a encodes E2M1 with the hardware cvt while sm_90a has none,
and the .so loads through tvm-ffi without a GPU, exports only the rendered op and rejects CPU
tensors.

``render_quantize`` / ``build_quantize_so`` are also used by the GPU test and the benchmark to
build the pre-pass alone (the nvfp4 module of the JIT also needs the attention template).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

QUANTIZE_TEMPLATE = "quantize.cu.jinja"
OPS = ("nvfp4", "fp8")
ARCHS = ("sm_90a", "sm_120a")
KERNELS = ("block_stats_kernel", "segment_reduce_kernel", "quantize_kernel")
TILE_KERNEL_MAX_REGISTERS = 80  # 3 CTAs of 256 threads an SM (__launch_bounds__(256, 3))


def render_quantize(op: str, arch: str) -> str:
    """The binding source of ``op`` for ``arch``, rendered with the JIT's template context."""
    from flashinfer_h3.jit import KernelConfig, render_template

    return render_template(QUANTIZE_TEMPLATE, KernelConfig(op, 128, arch).template_context())


def build_quantize_so(
    op: str, arch: str, out_dir: Path, include_dirs: tuple[Path, ...] = ()
) -> tuple[Path, str]:
    """Compile the pre-pass of ``op`` alone into ``out_dir``; returns (.so path, nvcc output).

    ``include_dirs`` come before the package's headers (to build against a modified header).
    The file names carry a digest of the source, the headers and the flags, so a build is
    reused from ``out_dir`` only when nothing it depends on changed.
    """
    from flashinfer_h3.jit import find_nvcc
    from flashinfer_h3.jit.env import include_dir, tvm_ffi_include_dirs
    from flashinfer_h3.jit.spec import cuda_flags, link_flags

    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    source = render_quantize(op, arch)
    includes = [*include_dirs, include_dir(), *tvm_ffi_include_dirs()]
    flags = [*cuda_flags(arch), *link_flags(), *[f"-I{d}" for d in includes]]
    digest = hashlib.sha256("\0".join([str(nvcc), source, *flags]).encode())
    for d in includes[: len(include_dirs) + 1]:
        for header in sorted(Path(d).glob("*.cuh")):
            digest.update(header.name.encode() + header.read_bytes())
    stem = f"quantize_{op}_{arch}_{digest.hexdigest()[:16]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    src, so, log_path = (out_dir / f"{stem}{ext}" for ext in (".cu", ".so", ".log"))
    if so.is_file() and log_path.is_file():
        return so, log_path.read_text()
    src.write_text(source)
    cmd = [str(nvcc), *flags, str(src), "-o", str(so)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        so.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{' '.join(cmd)}\n{log[-4000:]}")
    log_path.write_text(log)
    return so, log


def parse_ptxas(log: str) -> dict[tuple[str, str], dict[str, int]]:
    """``{(kernel short name, arch): {registers, stack, spill_stores, spill_loads}}``."""
    out: dict[tuple[str, str], dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            name = next((k for k in KERNELS if k in m.group(1)), m.group(1))
            current = (name, m.group(2))
            out[current] = {}
            continue
        if current is None:
            continue
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m:
            out[current].update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["registers"] = int(m.group(1))
    return out


@pytest.mark.parametrize("op", OPS)
def test_renders_only_its_op(op: str) -> None:
    text = render_quantize(op, "sm_90a")
    other = "fp8" if op == "nvfp4" else "nvfp4"
    assert f"TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_{op}," in text
    assert f"quantize_{other}" not in text
    assert "{{" not in text and "{%" not in text
    assert "use_fast_math" not in text


def test_unknown_op_is_a_compile_error() -> None:
    from flashinfer_h3.jit import render_template

    text = render_template(QUANTIZE_TEMPLATE, {"op": "int8", "head_dim": 128, "arch": "sm_90a"})
    assert "#error" in text


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, str]]:
    out = tmp_path_factory.mktemp("quantize_build")
    return {(op, arch): build_quantize_so(op, arch, out) for op in OPS for arch in ARCHS}


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", OPS)
def test_compiles_within_budget(builds, op: str, arch: str) -> None:
    _, log = builds[(op, arch)]
    usage = parse_ptxas(log)
    for kernel in KERNELS:
        info = usage.get((kernel, arch))
        assert info is not None, f"{kernel} missing from the {op} {arch} build:\n{log[-2000:]}"
        assert info["stack"] == 0 and info["spill_stores"] == 0 and info["spill_loads"] == 0, (
            f"{op} {arch} {kernel} uses local memory: {info}"
        )
        assert 0 < info["registers"] <= 255
    assert usage[("quantize_kernel", arch)]["registers"] <= TILE_KERNEL_MAX_REGISTERS


def _sass(so: Path) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not on PATH")
    return subprocess.run(
        [tool, "-sass", str(so)], capture_output=True, text=True, check=True
    ).stdout


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_e2m1_conversion_per_arch(builds, arch: str) -> None:
    sass = _sass(builds[("nvfp4", arch)][0])
    assert "LDL" not in sass and "STL" not in sass
    hardware = "F2FP.SATFINITE.E2M1" in sass
    assert hardware == (arch == "sm_120a"), f"{arch}: hardware E2M1 cvt present: {hardware}"
    assert "F2FP.SATFINITE.E4M3" in sass  # the UE4M3 scales use cvt on both archs


@pytest.mark.nvcc
@pytest.mark.parametrize("op", OPS)
def test_loads_and_checks_arguments_without_gpu(builds, op: str) -> None:
    torch = pytest.importorskip("torch")
    tvm_ffi = pytest.importorskip("tvm_ffi")
    mod = tvm_ffi.load_module(str(builds[(op, "sm_90a")][0]))
    other = "fp8" if op == "nvfp4" else "nvfp4"
    with pytest.raises(AttributeError):
        getattr(mod, f"quantize_{other}")
    fn = getattr(mod, f"quantize_{op}")
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    table = torch.zeros(2, dtype=torch.int32)
    blocks = torch.zeros(1, 4, dtype=torch.int32)
    regions = [torch.zeros(1)] * (8 if op == "nvfp4" else 7)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        fn(x, x, x, table, table, table, blocks, *regions)
    with pytest.raises(TypeError):
        fn(x, x, x)
