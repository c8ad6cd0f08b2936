"""Benchmark-only builds of the Hopper kernels (backends ``wgmma_fp16_nvfp4`` and ``wgmma_fp8``),
kernel only, against their production build.

Each row times the attention kernel of one build (KernelConfig flags changed) on one input whose
operands the production pre-pass wrote once, and compares its output with the production build's
(rel L2; 0 means the same numbers). NVFP4 builds: ``quantize_p=False`` (P packed to FP16 without its
NVFP4 quantisation), ``delta=False`` (the delta warpgroup writes the mask only), ``softmax=False``
(S packed as P: the GEMMs and the pipeline alone), ``fast_rounding=False`` (one P rounding path,
always saturating), ``fold_p_scale=False`` (the P groups' y = Ptil * r as an FMUL instead of 1 / s
folded into the exponentials), ``f16_rounding=False`` (rn_e2m1 of P on the FP32 y instead of on
f16x2 pairs), ``delta_mma_sync=True`` (the delta products as mma.sync on
warps 1-3 of the producer warpgroup, production until 2026-12-06, instead of a warpgroup's wgmma),
``delta_wgmma_regs=True`` (that warpgroup's wgmma with the K rows in registers through ldmatrix
instead of read from shared memory), ``wide_consumers=False`` (the consumers at 200 registers and
the delta warpgroup at 72 instead of 216 and 40), ``kv_copies=False`` (as FP8's, below),
``k_stages`` / ``v_stages`` (the K and V ring depths), ``poly_exp2_every`` (every n-th of a
tile's 64 exponentials a thread on the FMA pipe; production 0 = none), ``background_traffic``
(as FP8's, below: warps 1-3 of the TMA warpgroup). FP8 builds:
``tile_keys`` (256, production, or 128 keys a KV tile), ``poly_exp2_every`` (every n-th
exponential of each 128-key half on the FMA pipe; production 64, 0 = none), ``stages`` (the
K/V ring depth), ``interleaved_pack=False`` (P packed after the last of its exponentials,
production until 2026-12-07, instead of as they complete); with 128-key tiles only:
``softmax=False`` (S packed as P), ``o_update=False`` (no ``O = alpha O + Otmp``: its
instructions and registers); ``kv_copies=False`` (K and V copied into each ring slot once,
later tiles reuse it: what their way from L2 costs, energy included); ``cluster_ctas=2``
(clusters of two CTAs on pairs of query blocks sharing every K/V tile copy; its schedule from
``Plan.schedule_for``);
``q_in_kernel=1`` (Q quantised from the BF16 q by the producer warpgroup's warps 1-3 instead of read
as the pre-pass's codes; its time includes that work; ``2``: each consumer's 64 rows handed over on
a barrier of their own); ``background_traffic=1``
(warps 1-3 of the producer warpgroup stream the pre-pass's DRAM traffic and arithmetic beside the
attention: what a pre-pass fused into those warps would cost the kernel; ``2``: the same code
skipped at run time, what its presence costs). Both: ``register_usage_level``
(ptxas's scheduling knob, jit/modules.py: production 8), ``ping_pong=False`` (the two consumer
warpgroups' GEMM phases not ordered),
``wait_sleep_ns=0`` (the producer warpgroup's waits poll instead of suspending),
``dynamic_schedule`` (NVFP4: False, the CTAs stride statically over the items instead of drawing
them from a counter; FP8: True, the other way round), ``smem_carveout`` (the preferred shared-memory
carveout). FP8 also: the production build with its CTAs striding over the items (``--only
striding``), against the plan's balanced item schedule (flashinfer_h3/plan.py item_schedule).
benchmarks/RESULTS.md also records builds tried and removed (other GEMM-phase schedules, PV
accumulators over several tiles, PV under the softmax on 128-key tiles (``pv_overlap``, up to
b1ee1cb), a row-split softmax, waits and releases, a second Q block; the
NVFP4 builds listed with ``Nvfp4Variant`` in attention/sm90/nvfp4_kernel.cuh, in the tree up to
2ecf91a). Outputs
of the delta / softmax / O-update builds are not attention; their times say what each part costs.
Builds are timed in turn, in rounds (a drift of the clock under the power cap falls on all of
them alike), each round in another order (benchtools.round_order) and each build after
``--warmup-ms`` of untimed calls (default 1 s: it runs at its own clock, not at the previous
build's); median of CUDA-event timings over the rounds; TFLOP/s = 4 sum(L^2) H 128 / time. The
register usage level 10 rows give production's SASS (level 3: level 0's): the pairs say how far
apart the method puts one kernel timed twice.

    python benchmarks/bench_wgmma_variants.py [--op nvfp4,fp8] [--preset h3-10s,h3-mix]
        [--shape 30720*4:56] [--iters 5] [--rounds 3] [--warmup-ms 1000] [--only SUBSTRING,...]
        [--oracle] [--bias 2] [--build-only]

``--build-only`` compiles the selected builds into the JIT cache and exits (no GPU needed): with
``python -m flashinfer_h3 warmup --arch sm_90a`` it fills a cache that a device run can carry.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashinfer_h3 import backends
from flashinfer_h3.__main__ import (  # the bench command's
    PRESETS,
    _non_negative_float,
    _time_cuda,
    attention_flops,
)
from flashinfer_h3.benchtools import (
    HOPPER_MODULES,
    GpuSampler,
    KernelOnly,
    Timed,
    bench_shapes,
    round_order,
    rounds_summary,
    sampled_oracle,
)
from flashinfer_h3.jit import KernelConfig, build_module
from flashinfer_h3.jit.load import load_so
from flashinfer_h3.plan import cluster_ctas_of, with_schedule

MODULES = HOPPER_MODULES  # (module, backend) of each op

# The FP8 kernel's 128-key tiles with their exponential split (production until 2026-12-02).
T128: dict[str, Any] = {"tile_keys": 128, "poly_exp2_every": 32}

VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "nvfp4": {
        "production (P quantised)": {},
        "ptxas register usage level 5 (production until 2026-12-04)": {"register_usage_level": 5},
        "ptxas register usage level 0": {"register_usage_level": 0},
        "ptxas register usage level 3": {"register_usage_level": 3},
        "ptxas register usage level 10": {"register_usage_level": 10},
        "P quantised, always the saturating rounding": {"fast_rounding": False},
        "P quantised as Ptil * r (1 / s not folded into the exponentials)": {"fold_p_scale": False},
        "P rounded on FP32 values (production until 2026-12-04)": {"f16_rounding": False},
        "static item order (CTA b takes items b, b + G, ...)": {"dynamic_schedule": False},
        "delta products as mma.sync on three producer warps (production until 2026-12-06)":
            {"delta_mma_sync": True},
        "delta warpgroup's wgmma with the K rows in registers (ldmatrix)":
            {"delta_wgmma_regs": True},
        "consumers at 200 registers, the delta warpgroup at 72 (production until 2026-12-06)":
            {"wide_consumers": False},
        "benchmark build: P not quantised": {"quantize_p": False},
        "benchmark build: no delta products": {"delta": False},
        "benchmark build: no softmax (S packed as P)": {"softmax": False},
        "benchmark build: no softmax, no delta": {"softmax": False, "delta": False},
        "benchmark build: consumers not in ping-pong": {"ping_pong": False},
        "ring depths K 3, V 2": {"k_stages": 3},
        "largest shared-memory carveout": {"smem_carveout": 100},
        "producer warpgroup's waits polling (no suspend-time hint)": {"wait_sleep_ns": 0},
        "benchmark build: K and V copied once per ring slot": {"kv_copies": False},
        "benchmark build: the pre-pass's DRAM traffic streamed by TMA warps 1-3":
            {"background_traffic": 1},
        "benchmark build: the DRAM traffic's code, skipped at run time": {"background_traffic": 2},
        "1 in 64 exp2 on FMA (element 63)": {"poly_exp2_every": 64},
        "2 in 64 exp2 on FMA (elements 31, 63)": {"poly_exp2_every": 32},
        "1 in 64 exp2 on FMA (element 47)": {"poly_exp2_every": 48},
    },
    "fp8": {
        "production (256-key tiles, 2 in 128 exp2 on FMA, P packed as they complete)": {},
        "Q quantised in the kernel by the producer warpgroup": {"q_in_kernel": 1},
        "Q quantised in the kernel, one Q hand-off per consumer": {"q_in_kernel": 2},
        "benchmark build: the pre-pass's DRAM traffic streamed by producer warps 1-3":
            {"background_traffic": 1},
        "benchmark build: the DRAM traffic's code, skipped at run time": {"background_traffic": 2},
        "ptxas register usage level 5 (production until 2026-12-04)": {"register_usage_level": 5},
        "ptxas register usage level 0": {"register_usage_level": 0},
        "ptxas register usage level 10": {"register_usage_level": 10},
        "clusters of 2 CTAs sharing each K/V tile copy": {"cluster_ctas": 2},
        "clusters of 2 CTAs, ring depth 3": {"cluster_ctas": 2, "stages": 3},
        "clusters of 2 CTAs, producer's waits polling": {"cluster_ctas": 2, "wait_sleep_ns": 0},
        "128-key tiles, 1 in 32 exp2 on FMA (production until 2026-12-02)": T128,
        "P packed after its exponentials (production until 2026-12-07)":
            {"interleaved_pack": False},
        "all exp2 on MUFU": {"poly_exp2_every": 0},
        "4 in 128 exp2 on FMA": {"poly_exp2_every": 32},
        "8 in 128 exp2 on FMA": {"poly_exp2_every": 16},
        "2 in 128 exp2 on FMA (elements 47 of each half)": {"poly_exp2_every": 48},
        "benchmark build: consumers not in ping-pong": {"ping_pong": False},
        "producer's waits polling (no suspend-time hint)": {"wait_sleep_ns": 0},
        "ring depth 3": {"stages": 3},
        "largest shared-memory carveout": {"smem_carveout": 100},
        "benchmark build: K and V copied once per ring slot": {"kv_copies": False},
        "128-key tiles: dynamic item order (the NVFP4 kernel's: a counter)": {
            **T128, "dynamic_schedule": True},
        "128-key tiles: benchmark build: no softmax (S packed as P)": {**T128, "softmax": False},
        "128-key tiles: benchmark build: no O = alpha O + Otmp": {**T128, "o_update": False},
        "128-key tiles: ring depth 4": {**T128, "stages": 4},
    },
}


def timed_with_clocks(fn: Callable[[], Any], iters: int, warmup_ms: float) -> Timed:
    """Median ms of ``fn`` (``_time_cuda``) and, where ``nvidia-smi`` is on the PATH, the median SM
    clock (MHz) and board power (W) sampled meanwhile (else None; benchtools.GpuSampler): the H200
    runs these kernels at its 700 W cap, so a build's clock is part of its time."""
    sampler = GpuSampler(torch.cuda.current_device())  # over the timed calls only
    ms = _time_cuda(fn, iters, warmup=1, warmup_ms=warmup_ms, during=sampler)
    if sampler.state is None:
        return ms, None, None
    return ms, sampler.state.sm_clock_mhz, sampler.state.power_w


def selected_variants(op: str, only: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The builds of ``op`` that ``--only`` selects (the production build always)."""
    return [(name, flags) for name, flags in VARIANTS[op].items()
            if not (only and flags and not any(part in name for part in only.split(",")))]


def run(op: str, preset: str, lengths: tuple[int, ...], heads: int, iters: int, rounds: int,
        only: str | None, extra: list[tuple[str, Path]], oracle: bool = False,
        bias: float = 0.0, warmup_ms: float = 1000.0) -> None:
    """Times every selected build of ``op`` on one input: ``rounds`` rounds, each timing every
    build once (``iters`` calls after ``warmup_ms`` of untimed ones) in turn, round r from build
    r on, so that a slow drift of the clock under the power cap falls on all builds alike and
    none inherits the same predecessor's clock every time; prints the median over the rounds.
    ``oracle``: also each build's relative L2 against the FP32 oracle on sampled rows
    (benchtools.sampled_oracle); ``bias``: q and k get a per-channel bias of ``bias`` N(0, 1)
    (SPEC 5's real-model-like inputs)."""
    tokens = sum(lengths)
    bounds = tuple(int(x) for x in torch.tensor((0, *lengths)).cumsum(0).tolist())
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, heads, 128, generator=g, device="cuda")
               for _ in range(3))
    if bias:
        q += bias * torch.randn(heads, 128, generator=g, device="cuda")
        k += bias * torch.randn(heads, 128, generator=g, device="cuda")
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    sampled = sampled_oracle(q, k, v, bounds) if oracle else None
    out = torch.empty_like(q)
    module_name, backend_name = MODULES[op]
    backend = backends.get(op, backend_name)
    flops = attention_flops(lengths, heads)
    builds: list[tuple[str, KernelOnly, str]] = []
    production = None
    selected: list[tuple[str, Path]] = []
    for name, flags in selected_variants(op, only):
        config = KernelConfig(module_name, arch="sm_90a", flags=flags)
        selected.append((name, Path(build_module(config))))
    selected += [(f"module {path.parent.name}/{path.name}", path)
                 for label, path in extra if label == op]
    for name, path in selected:
        module = load_so(path)
        prepared = backends.Prepared(backend, backend.make_launcher(module, backend), q.device)
        # Every build's prime() runs the same production pre-pass into the same workspace views.
        ko = KernelOnly(op, prepared, q, k, v, out, bounds, 128**-0.5)
        ko.prime()
        if op == "fp8" and name == selected[0][0]:
            dev = torch.cuda.current_device()
            print(f"fp8 production build: {cluster_ctas_of(module)} CTAs a cluster, "
                  f"{module.attention_fp8_wgmma_max_active_clusters(dev)} clusters at once, "
                  f"schedule of {ko.plan.tables['cta_begin'].numel() - 1} CTAs", flush=True)
        result = ko.run().clone()
        diff = ""
        if production is None:
            production = result
        else:
            ref = production.float()
            rel = ((result.float() - ref).norm() / ref.norm()).item()
            changed = (result != production).float().mean().item()
            diff = f", rel L2 vs production {rel:.2e} ({changed:.1e} of the elements differ)"
        if sampled is not None:
            diff += f", rel L2 vs FP32 oracle {sampled.rel_l2(result):.5f}"
        builds.append((name, ko, diff))
    if op == "fp8" and production is not None and (not only or "striding" in only):
        # The production build with the CTAs striding over the items (CTA b takes b, b + G, ...;
        # the order before the plan's balanced schedule, and a captured call's): same kernel,
        # other item lists.
        module = load_so(selected[0][1])
        prepared = backends.Prepared(backend, backend.make_launcher(module, backend), q.device)
        ko = KernelOnly(op, prepared, q, k, v, out, bounds, 128**-0.5)
        ko.prime()
        ko.plan = with_schedule(ko.plan, cluster_ctas_of(module), striding=True)
        result = ko.run().clone()
        rel = ((result.float() - production.float()).norm() / production.float().norm()).item()
        builds.append(("production, striding item order", ko, f", rel L2 vs production {rel:.2e}"))
    times: list[list[Timed]] = [[] for _ in builds]
    for r in range(rounds):
        for i in round_order(len(builds), r):  # predecessors change from round to round
            times[i].append(timed_with_clocks(builds[i][1].run, iters, warmup_ms))
    for (name, _, diff), measured in zip(builds, times, strict=True):
        ms, spread, clocks = rounds_summary(measured)
        print(f"{op} {preset} ({tokens} x {heads}): {name}: {ms:.3f} ms "
              f"(rounds spread {100 * spread:.1f} %), {flops / ms / 1e9:.1f} TFLOP/s{diff}{clocks}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="nvfp4,fp8", help="comma-separated among nvfp4, fp8")
    ap.add_argument("--preset", default="h3-10s",
                    help=f"comma-separated among {', '.join(PRESETS)}")
    ap.add_argument("--shape", action="append", default=[], metavar="LENGTHS:HEADS",
                    help="an extra shape, e.g. 30720*4:56 (four 30,720-token segments, 56 heads) "
                    "or 30720,15360:56; repeatable")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per build and round")
    ap.add_argument("--warmup-ms", type=_non_negative_float, default=1000.0,
                    help="untimed calls of each build for this long before its timed ones (its "
                    "clock under the power cap settles; the bench command's --warmup-ms)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds; each times every build in turn, the median over them is reported")
    ap.add_argument("--so", action="append", default=[], metavar="OP=PATH",
                    help="also time this built module of op (e.g. fp8=old/fp8_wgmma.so: a build of "
                    "another tree); repeatable")
    ap.add_argument("--only", default=None,
                    help="run only the variants whose name contains one of these comma-separated "
                    "substrings (and the production build)")
    ap.add_argument("--oracle", action="store_true",
                    help="also print each build's relative L2 against the FP32 oracle "
                    "(sampled rows)")
    ap.add_argument("--bias", type=float, default=0.0,
                    help="a per-channel bias of BIAS N(0, 1) on q and k (real-model-like inputs)")
    ap.add_argument("--build-only", action="store_true",
                    help="compile the selected builds into the JIT cache and exit (no GPU needed)")
    args = ap.parse_args()
    ops = args.op.split(",")
    for op in ops:
        if op not in MODULES:
            ap.error(f"--op: unknown op {op!r}; expected nvfp4 or fp8")
    if args.build_only:
        for op in ops:
            for name, flags in selected_variants(op, args.only):
                path = build_module(KernelConfig(MODULES[op][0], arch="sm_90a", flags=flags))
                print(f"{op}: {name}: {path}")
        return
    try:
        shapes = bench_shapes(args.preset, args.shape, PRESETS)
    except ValueError as e:
        ap.error(str(e))
    extra: list[tuple[str, Path]] = []  # (op, module): every --so, in order
    for text in args.so:
        op_name, _, path_text = text.partition("=")
        if op_name not in MODULES or not path_text or not Path(path_text).is_file():
            ap.error(f"--so: expected OP=PATH (OP nvfp4 or fp8, an existing file), got {text!r}")
        extra.append((op_name, Path(path_text)))
    for name, lengths_, heads in shapes:
        for op in ops:
            run(op, name, lengths_, heads, args.iters, args.rounds, args.only, extra,
                args.oracle, args.bias, args.warmup_ms)


if __name__ == "__main__":
    main()
