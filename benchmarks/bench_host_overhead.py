"""Host (CPU) time of one cached-plan call with ``cu_seqlens_host`` (SPEC 6: at most ~20 us).

The GPU is kept busy by a long sleep kernel queued first, so the host never waits for it and the
per-call time is pure launch-path cost, as long as the timed launches fit in the GPU's launch
queue (about a thousand kernels): a call of the Hopper NVFP4 backend launched 7 kernels when its
pre-pass still had a separate FP16 expansion (three pre-pass, three expansion, the attention
kernel; now 4 and the item counter's memset), so 200 calls overflowed it and the host then
waited for the sleep (a measured "519 us" a call was that wait). Hence 64 calls a repeat.
The call is split into its parts:

- ``full``: the public operator (validation, plan and workspace lookup, the backend's two tvm-ffi
  calls: the pre-pass and the attention kernel);
- ``python``: the same call with the kernel backend replaced by a no-op (our Python only);
- ``kernels``: the tvm-ffi calls alone, arguments prepared once (binding + launches);
- ``torch add_``: one tiny torch launch, the yardstick of this machine's launch cost.

Usage: ``python benchmarks/bench_host_overhead.py [--calls 64] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import torch

from flashinfer_h3 import backends
from flashinfer_h3 import diffusion_ops as ops
from flashinfer_h3.plan import PLANS
from flashinfer_h3.workspace import eager_views, layout_for


def _host_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` host microseconds per call, the GPU held busy meanwhile."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work ahead of the timed launches
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=64,
                        help="calls per timed repeat; keep calls x launches per call below ~1000")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    bounds = [0, 64, 128]
    q, k, v = (torch.randn(128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def full() -> None:
        ops.varlen_attention_nvfp4(q, k, v, cu, out, cu_seqlens_host=bounds)

    for _ in range(10):
        full()  # JIT load, plan and workspace creation
    torch.cuda.synchronize()

    backend = backends.prepared("nvfp4", q.device)
    print(f"backend: {backend.backend.label}")
    plan = PLANS.get(bounds, 1, q.device)
    views = eager_views(layout_for(backend.workspace or "nvfp4", 128, 1, 2), q.device,
                        torch.cuda.current_stream().cuda_stream)

    def kernels() -> None:
        backend.launch(q, k, v, out, ops.DEFAULT_SOFTMAX_SCALE, tuple(bounds), plan, views)

    results = {"full": _host_us(full, args.calls), "kernels": _host_us(kernels, args.calls)}
    # Our Python alone: the same call with the prepared launcher replaced by a no-op (the
    # registry's cache entry is swapped, so the lookup itself is still measured).
    key = backends.cache_key("nvfp4", q.device)
    real = backends._PREPARED[key]
    backends._PREPARED[key] = dataclasses.replace(real, launch=lambda *a: None)
    try:
        results["python"] = _host_us(full, args.calls)
    finally:
        backends._PREPARED[key] = real
    results["torch add_"] = _host_us(lambda: out.add_(0), args.calls)

    print(f"host time per call on {torch.cuda.get_device_name()} (best of 5 x {args.calls}):")
    for name, us in results.items():
        print(f"  {name:12s} {us:7.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
