"""Benchmark-only builds of the Hopper kernels (backends ``wgmma_fp16_nvfp4`` and ``wgmma_fp8``),
kernel only, against their production build.

Each row times the attention kernel of one build (KernelConfig flags changed) on one input whose
operands the production pre-pass wrote once, and compares its output with the production
build's (rel L2; 0 means the same numbers). NVFP4 builds: ``quantize_p=False`` (P packed to FP16
without its NVFP4 quantisation), ``delta=False`` (the delta warps skip their products),
``softmax=False`` (S packed as P: the GEMMs and the pipeline alone), ``fast_rounding=False`` (one
P rounding path, always saturating). FP8 builds: ``poly_exp2_every`` (every n-th exponential on
the FMA pipe; production 16, 0 = none). Both: ``ping_pong=False`` (the two consumer warpgroups'
GEMM phases not ordered). benchmarks/RESULTS.md also records builds tried and
removed (other GEMM-phase schedules, waits and releases).
Outputs of the delta / softmax builds are not attention; their times say what each part costs.
Median of CUDA-event timings; TFLOP/s = 4 sum(L^2) H 128 / time.

    python benchmarks/bench_wgmma_variants.py [--op nvfp4,fp8] [--preset h3-10s,h3-mix]
        [--shape 30720*4:56] [--iters 5] [--only SUBSTRING,...]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from flashinfer_h3 import backends
from flashinfer_h3.__main__ import PRESETS, _time_cuda, attention_flops  # the bench command's
from flashinfer_h3.benchtools import KernelOnly
from flashinfer_h3.jit import KernelConfig, build_module
from flashinfer_h3.jit.load import load_so

MODULES = {"nvfp4": ("nvfp4_wgmma", "wgmma_fp16_nvfp4"), "fp8": ("fp8_wgmma", "wgmma_fp8")}

VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "nvfp4": {
        "production (P quantised)": {},
        "P quantised, always the saturating rounding": {"fast_rounding": False},
        "benchmark build: P not quantised": {"quantize_p": False},
        "benchmark build: no delta products": {"delta": False},
        "benchmark build: no softmax (S packed as P)": {"softmax": False},
        "benchmark build: no softmax, no delta": {"softmax": False, "delta": False},
        "benchmark build: consumers not in ping-pong": {"ping_pong": False},
    },
    "fp8": {
        "production (fused phases, 1 in 16 exp2 on FMA)": {},
        "all exp2 on MUFU": {"poly_exp2_every": 0},
        "1 in 8 exp2 on FMA": {"poly_exp2_every": 8},
        "benchmark build: consumers not in ping-pong": {"ping_pong": False},
    },
}


def run(op: str, preset: str, lengths: tuple[int, ...], heads: int, iters: int,
        only: str | None) -> None:
    tokens = sum(lengths)
    bounds = tuple(int(x) for x in torch.tensor((0, *lengths)).cumsum(0).tolist())
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, heads, 128, generator=g, device="cuda").bfloat16()
               for _ in range(3))
    out = torch.empty_like(q)
    module_name, backend_name = MODULES[op]
    backend = backends.get(op, backend_name)
    flops = attention_flops(lengths, heads)
    production = None
    for name, flags in VARIANTS[op].items():
        if only and flags and not any(part in name for part in only.split(",")):
            continue
        module = load_so(build_module(KernelConfig(module_name, arch="sm_90a", flags=flags)))
        prepared = backends.Prepared(backend, backend.make_launcher(module, backend), q.device)
        ko = KernelOnly(op, prepared, q, k, v, out, bounds, 128**-0.5)
        ko.prime()
        ms = _time_cuda(ko.run, iters, warmup=1)
        result = out.clone()
        diff = ""
        if production is None:
            production = result
        else:
            ref = production.float()
            rel = ((result.float() - ref).norm() / ref.norm()).item()
            diff = f", rel L2 vs production {rel:.2e}"
        print(f"{op} {preset} ({tokens} x {heads}): {name}: {ms:.3f} ms, "
              f"{flops / ms / 1e9:.1f} TFLOP/s{diff}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="nvfp4,fp8", help="comma-separated among nvfp4, fp8")
    ap.add_argument("--preset", default="h3-10s",
                    help=f"comma-separated among {', '.join(PRESETS)}")
    ap.add_argument("--shape", action="append", default=[], metavar="LENGTHS:HEADS",
                    help="an extra shape, e.g. 30720*4:56 (four 30,720-token segments, 56 heads) "
                    "or 30720,15360:56; repeatable")
    ap.add_argument("--iters", type=int, default=5, help="timed calls; the median is reported")
    ap.add_argument("--only", default=None,
                    help="run only the variants whose name contains one of these comma-separated "
                    "substrings (and the production build)")
    args = ap.parse_args()
    shapes: list[tuple[str, tuple[int, ...], int]] = []
    for preset in args.preset.split(",") if args.preset else ():
        if preset not in PRESETS:
            ap.error(f"--preset: unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
        shapes.append((preset, PRESETS[preset].lengths, PRESETS[preset].heads))
    for text in args.shape:
        try:
            lengths_text, heads_text = text.split(":")
            lengths: list[int] = []
            for part in lengths_text.split(","):
                length, _, count = part.partition("*")
                lengths += [int(length)] * int(count or 1)
            shapes.append((text, tuple(lengths), int(heads_text)))
        except ValueError:
            ap.error(f"--shape: expected LENGTHS:HEADS such as 30720*4:56, got {text!r}")
    for name, lengths_, heads in shapes:
        for op in args.op.split(","):
            if op not in MODULES:
                ap.error(f"--op: unknown op {op!r}; expected nvfp4 or fp8")
            run(op, name, lengths_, heads, args.iters, args.only)


if __name__ == "__main__":
    main()
