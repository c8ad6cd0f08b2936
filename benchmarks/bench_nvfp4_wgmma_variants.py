"""Benchmark-only builds of the Hopper NVFP4 kernel (backend ``wgmma_fp16_nvfp4``), kernel only.

Times the attention kernel of the production build and of builds with a KernelConfig flag
changed, on one input whose operands the production pre-pass wrote once: ``quantize_p=False``
(P packed to FP16 without its NVFP4 quantisation), ``delta=False`` (the delta warps skip their
products), ``softmax=False`` (S packed as P: the GEMMs and the pipeline alone), and
``fast_rounding=False`` (a production alternative: one P rounding path, always saturating).
Outputs of the delta / softmax builds are not attention; their times say what each part costs.
Median of CUDA-event timings; TFLOP/s = 4 L^2 H 128 / time.

    python benchmarks/bench_nvfp4_wgmma_variants.py [--tokens 61440] [--heads 56] [--iters 5]
"""

from __future__ import annotations

import argparse

import torch

from flashinfer_h3 import backends
from flashinfer_h3.__main__ import _time_cuda  # the bench command's timer
from flashinfer_h3.benchtools import KernelOnly
from flashinfer_h3.jit import KernelConfig, build_module
from flashinfer_h3.jit.load import load_so

VARIANTS: dict[str, dict[str, bool]] = {
    "production (P quantised)": {},
    "P quantised, always the saturating rounding": {"fast_rounding": False},
    "benchmark build: P not quantised": {"quantize_p": False},
    "benchmark build: no delta products": {"delta": False},
    "benchmark build: no softmax (S packed as P)": {"softmax": False},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=61440, help="one segment of this many tokens")
    ap.add_argument("--heads", type=int, default=56)
    ap.add_argument("--iters", type=int, default=5, help="timed calls; the median is reported")
    args = ap.parse_args()
    T, H = args.tokens, args.heads
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(T, H, 128, generator=g, device="cuda").bfloat16() for _ in range(3))
    out = torch.empty_like(q)
    bounds = (0, T)
    backend = backends.get("nvfp4", "wgmma_fp16_nvfp4")
    flops = 4.0 * T * T * H * 128
    reference_out = None
    for name, flags in VARIANTS.items():
        module = load_so(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a", flags=flags)))
        prepared = backends.Prepared(backend, backend.make_launcher(module, backend), q.device)
        ko = KernelOnly("nvfp4", prepared, q, k, v, out, bounds, 128**-0.5)
        ko.prime()
        ms = _time_cuda(ko.run, args.iters, warmup=1)
        result = out.clone()
        diff = ""
        if reference_out is None:
            reference_out = result
        else:
            ref = reference_out.float()
            rel = ((result.float() - ref).norm() / ref.norm()).item()
            diff = f", rel L2 vs production {rel:.4f}"
        print(f"{T} x {H}: {name}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s{diff}", flush=True)


if __name__ == "__main__":
    main()
