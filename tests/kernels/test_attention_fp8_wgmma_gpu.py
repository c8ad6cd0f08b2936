"""GPU tests of the Hopper wgmma FP8 attention kernel (module ``fp8_wgmma``, sm_90a only).

Both FP8 kernels read the same workspace (docs/spec.md section 4), so this file reruns the
kernel-independent cases of ``test_attention_fp8_mma_sync_gpu.py`` on this kernel: the
``module`` fixture below replaces that file's, and its ``run_kernel`` calls whichever attention
export the module has. Every case runs the pre-pass into a poisoned workspace and the kernel into
a NaN-poisoned output with guard rows, and compares with the reference emulation on the kernel's
own workspace stages (relative L2 <= 0.02) and with the FP32 oracle (docs/spec.md section 5 bars
on Gaussian inputs at the default scale). Shapes: empty, 1, 15-17, 63-65, 127-129, 1000,
4095/4097, 16,384 tokens, packed segments with empty ones, 10,000 segments of 0..7 tokens, 1-56
heads, biased and heavy-tailed inputs, two softmax scales; execution: workspace unchanged,
determinism, a side stream, CUDA-graph capture replayed on new inputs, no tokens. Added here:
the public operator's auto backend on 9.0 through the whole call path, the benchmark-only
builds of both Hopper kernels that change the schedule, not the arithmetic, against production,
and the FP8 build that quantises Q in the kernel (``q_in_kernel``): bit-identical to production
with the workspace's Q poisoned, and its FP64 row scales on every BF16 magnitude.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_attention_fp8_mma_sync_gpu import (  # noqa: F401  (collected again, on this kernel)
    test_56_heads_multi_block,
    test_10000_short_segments,
    test_cuda_graph_capture_and_replay,
    test_heads,
    test_no_tokens_launches_nothing,
    test_packed,
    test_real_model_like_inputs,
    test_reference_operands,
    test_single_segment,
    test_single_segment_16384,
    test_softmax_scale,
    test_workspace_unchanged_deterministic_side_stream,
)
from test_attention_nvfp4_gpu import make_qkv, rel_l2

from flashinfer_h3 import reference as R

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def module() -> Any:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma FP8 kernel is a Hopper (compute capability 9.0) kernel")
    from flashinfer_h3.jit import get_module

    return get_module("fp8_wgmma")


def test_item_counter_checks(module: Any) -> None:
    """The binding names a wrong item counter (dtype, device, size): the dynamic item order's
    builds draw from it (a poisoned one works: the binding zeroes it before such a launch)."""
    from test_attention_fp8_mma_sync_gpu import (
        DEFAULT_SCALE,
        _call,
        cluster_ctas_of,
        run_kernel,
        schedule_of,
    )

    call, _ = _call(module, [40], 2, seed=3)
    out = torch.empty(40, 2, 128, dtype=torch.bfloat16, device="cuda")
    used = call.host.vkey_start[-1]
    schedule = schedule_of(call, cluster_ctas=cluster_ctas_of(module))
    for bad in (torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int32),
                torch.zeros(0, dtype=torch.int32, device="cuda")):
        with pytest.raises(ValueError, match="item_counter"):
            module.attention_fp8_wgmma(out, call.q, *call.kernel_args(), bad, *schedule,
                                       DEFAULT_SCALE, used)
    assert torch.isfinite(run_kernel(module, call)).all()


def test_item_schedule_checks(module: Any) -> None:
    """The binding names a wrong item schedule: ``cta_begin`` of another dtype, on the CPU,
    without a CTA or with a CTA count that is not a multiple of the cluster's, ``cta_items`` not
    of the schedule's size."""
    from test_attention_fp8_mma_sync_gpu import DEFAULT_SCALE, _call, cluster_ctas_of, schedule_of

    call, _ = _call(module, [40, 300], 2, seed=3)
    out = torch.empty(340, 2, 128, dtype=torch.bfloat16, device="cuda")
    used = call.host.vkey_start[-1]
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    begin, items = schedule_of(call, cluster_ctas=cluster_ctas_of(module))
    cases = [(begin.long(), items, "cta_begin"), (begin.cpu(), items, "cta_begin"),
             (begin[:1], items, "cta_begin"), (begin, items[:-1], "cta_items"),
             (begin, items.long(), "cta_items")]
    if cluster_ctas_of(module) == 2:
        cases.append((begin[:-1], items, "cta_begin"))  # an odd number of CTAs
    for b, i, name in cases:
        with pytest.raises(ValueError, match=name):
            module.attention_fp8_wgmma(out, call.q, *call.kernel_args(), counter, b, i,
                                       DEFAULT_SCALE, used)


@pytest.mark.parametrize("build", ["production", "clusters"])
@pytest.mark.parametrize("lengths", [[1, 16, 0, 145, 138, 400, 800], [9000, 300, 5000, 2084]],
                         ids=["packed", "mixed-16384"])
def test_any_item_schedule_same_output(module: Any, lengths: list[int], build: str) -> None:
    """The output does not depend on which CTA runs which item, or in which order: the plan's
    balanced schedule, striding (a captured call's), one CTA running every item backwards, more
    CTAs than SMs, and a random assignment to 7 CTAs all give production's bits; the same for
    the clustered build (``cluster_ctas=2``) with pairs of blocks dealt to clusters (odd block
    counts: a pair's second CTA without rows of its own)."""
    import random

    from test_attention_fp8_mma_sync_gpu import _call, cluster_ctas_of, run_kernel

    from flashinfer_h3.plan import block_pairs, striding_pair_schedule, striding_schedule

    call, _ = _call(module, lengths, 3, seed=11)
    base = run_kernel(module, call)
    if build == "clusters":
        module = benchmark_build("fp8_wgmma", {"cluster_ctas": 2})
    items = call.host.num_qblocks * 3
    dev = torch.device("cuda", torch.cuda.current_device())
    clustered = cluster_ctas_of(module) == 2

    def split(flat: list[int] | torch.Tensor, ctas: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = torch.as_tensor(flat, dtype=torch.int32).to(dev)
        return flat[: ctas + 1], flat[ctas + 1 :]

    # Units: items, or with clusters the pairs of blocks (each CTA of a cluster one side).
    units: list = block_pairs(call.host, 3) if clustered else list(range(items))
    rng = random.Random(5)
    owner = [rng.randrange(7) for _ in units]
    unit_runs = [[u for u, b in zip(units, owner, strict=True) if b == c] for c in range(7)]
    for run in unit_runs:
        rng.shuffle(run)

    def layout(runs: list[list]) -> list[int]:
        cta_runs = ([[pair[r] for pair in run] for run in runs for r in range(2)] if clustered
                    else runs)
        begin, flat = [0], []
        for run in cta_runs:
            flat.extend(run)
            begin.append(len(flat))
        return begin + flat + [0] * ((2 if clustered else 1) * items - len(flat))

    def striding(ctas: int) -> tuple[torch.Tensor, torch.Tensor]:
        if clustered:
            qblocks, qblock_start = call.tables[3], call.tables[2]
            return split(striding_pair_schedule(qblocks, qblock_start, 3, ctas), ctas)
        return split(striding_schedule(items, ctas, dev), ctas)

    per = 2 if clustered else 1
    schedules = {
        "striding": striding(132),
        "one cluster, backwards": split(layout([units[::-1]]), per),
        "600 CTAs": striding(600),
        "random, 7 clusters": split(layout(unit_runs), 7 * per),
    }
    assert torch.isfinite(base).all()
    for name, schedule in schedules.items():
        got = run_kernel(module, call, schedule=schedule)
        assert torch.equal(got, base), name
        assert torch.isnan(got.guard).all(), name  # type: ignore[attr-defined]


def test_public_operator_auto_backend(module: Any) -> None:
    """On 9.0 the FP8 operator's auto backend is this kernel, through the whole call path, and
    agrees with the reference (and the mma.sync kernel, selected explicitly)."""
    from flashinfer_h3 import backends, varlen_attention_fp8

    dev = torch.device("cuda", torch.cuda.current_device())
    assert backends.resolve("fp8", torch.cuda.get_device_capability(dev)).name == "wgmma_fp8"
    bounds = [0, 700, 700, 1033]
    q, k, v = make_qkv(bounds[-1], 3, "gauss", 31)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    out = varlen_attention_fp8(q, k, v, cu, cu_seqlens_host=bounds)
    with backends.use_backend("fp8", "mma_sync_fp8"):
        other = varlen_attention_fp8(q, k, v, cu, cu_seqlens_host=bounds)
    ref = R.varlen_attention_fp8_reference(q, k, v, bounds)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    for got in (out, other):
        assert rel_l2(got, ref) <= 0.02


def kernel_only_outputs(
    op: str, backend_name: str, modules: list[Any], bounds: tuple[int, ...]
) -> list[torch.Tensor]:
    """The attention kernel's output of each module (production first) on one 3-head Gaussian
    input, each after its own module's pre-pass (benchtools.KernelOnly, as the variant bench)."""
    from flashinfer_h3 import backends
    from flashinfer_h3.benchtools import KernelOnly

    backend = backends.get(op, backend_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v = make_qkv(bounds[-1], 3, "gauss", 7)
    outputs = []
    for mod in modules:
        prepared = backends.Prepared(backend, backend.make_launcher(mod, backend), dev)
        ko = KernelOnly(op, prepared, q, k, v, torch.empty_like(q), bounds, 128**-0.5)
        ko.prime()
        outputs.append(ko.run().clone())
    torch.cuda.synchronize()
    return outputs


def benchmark_build(module_name: str, flags: dict[str, Any]) -> Any:
    from pathlib import Path

    from flashinfer_h3.jit import KernelConfig, build_module
    from flashinfer_h3.jit.load import load_so

    return load_so(Path(build_module(KernelConfig(module_name, arch="sm_90a", flags=flags))))


# The third: 131 blocks x 3 heads = 393 items, more than two per CTA on any Hopper GPU, so the
# dynamic item order draws from its counter (the others have fewer items than CTAs).
BENCHMARK_BOUNDS = [(0, 1, 17, 17, 162, 300, 700, 1500), (0, 4097), (0, 9000, 9300, 14300, 16384)]
BENCHMARK_IDS = ["packed", "4097", "mixed-16384"]


# The 128-key tiles with their exponential split (production until 2026-12-02): the reference
# build of the schedule variants that exist only with 128-key tiles.
T128 = {"tile_keys": 128, "poly_exp2_every": 32}


@pytest.mark.parametrize(
    ("flags", "base_flags"),
    [({"stages": 3}, None), ({"ping_pong": False}, None), ({"wait_sleep_ns": 0}, None),
     ({"cluster_ctas": 2}, None), ({**T128, "dynamic_schedule": True}, T128),
     ({"q_in_kernel": 1}, None), ({"background_traffic": 1}, None),
     ({"interleaved_pack": False}, None)],
    ids=["ring-3", "no-ping-pong", "polling-waits", "clusters", "dynamic-order-128", "q-in-kernel",
         "background-traffic", "pack-after-exponentials"],
)
@pytest.mark.parametrize("bounds", BENCHMARK_BOUNDS, ids=BENCHMARK_IDS)
def test_benchmark_builds_match_production(
    module: Any, flags: dict[str, Any], base_flags: dict[str, Any] | None, bounds: tuple[int, ...]
) -> None:
    """The benchmark-only builds that change the schedule but not the arithmetic
    (benchmarks/bench_wgmma_variants.py: a deeper ring, no ping-pong, the producer's waits
    polling, clusters of two CTAs sharing each K/V tile copy, on a schedule of block pairs;
    with 128-key tiles the dynamic item order; Q quantised in the kernel after a pre-pass
    without Q; the producer warpgroup's warps 1-3
    streaming the pre-pass's traffic, rewriting the Q codes with their own bytes while the
    consumers read them; P packed after the last of its exponentials, production until
    2026-12-07) give their reference build's output
    (production, or the 128-key build) bit for bit. On segments of 1, 17, 162, ... tokens (single
    and partial tiles), on one of 4,097 (17 tiles of 256 keys: both ring parities, a masked last
    tile with one K-scale block), and on four of 300 to 9,000 tokens (393 items: several drawn
    per CTA)."""
    base_module = module if base_flags is None else benchmark_build("fp8_wgmma", base_flags)
    base, variant = kernel_only_outputs(
        "fp8", "wgmma_fp8", [base_module, benchmark_build("fp8_wgmma", flags)], bounds
    )
    assert torch.isfinite(base).all() and torch.isfinite(variant).all()
    assert torch.equal(base, variant)


@pytest.mark.parametrize("flags", [{"q_in_kernel": 1}, {"q_in_kernel": 1, "cluster_ctas": 2},
                                   {"q_in_kernel": 2}],
                         ids=["q-in-kernel", "q-in-kernel-clusters", "q-in-kernel-per-consumer"])
@pytest.mark.parametrize(("lengths", "kind"),
                         [([1, 16, 0, 145, 138, 400, 800], "heavy"), ([4097], "biased"),
                          ([9000, 300, 5000, 2084], "gauss"), ([300, 0, 700], "tiny")],
                         ids=["packed-heavy", "4097-biased", "mixed-16384", "tiny"])
def test_q_quantised_in_the_kernel_matches_production(
    module: Any, flags: dict[str, Any], lengths: list[int], kind: str
) -> None:
    """The ``q_in_kernel`` build quantises Q from the BF16 q itself (sm90/fp8_q_quantizer.cuh)
    with the pre-pass's arithmetic: with the workspace's Q codes poisoned (E4M3 NaN) and its Q
    scales NaN, its output equals production's bit for bit and it rewrites every scale as the
    pre-pass wrote it. Zero rows (s = 0), rows of magnitudes over decades and ~1e-37 rows (scales
    flushed to 0, SPEC 4.1) included; with clusters of two CTAs too (a pair's kNoRows entry writes
    no scale); and with one Q hand-off per consumer (q_in_kernel = 2)."""
    from test_attention_fp8_mma_sync_gpu import prepare, run_kernel
    from test_attention_nvfp4_gpu import bounds_of

    q, k, v = make_qkv(sum(lengths), 3, kind, seed=5)
    q[::7, 1] = 0.0  # zero rows: scale 0, codes 0
    call = prepare(module, q, k, v, bounds_of(lengths))
    base = run_kernel(module, call)
    scales = call.views["q_scales"].clone()
    call.views["q_scales"].fill_(math.nan)
    call.views["q_codes"].fill_(0x7F)
    variant = run_kernel(benchmark_build("fp8_wgmma", flags), call)
    assert torch.isfinite(base).all()
    assert torch.equal(base, variant)
    assert torch.equal(call.views["q_scales"], scales)


def test_q_in_kernel_scales_on_every_bf16_magnitude(module: Any) -> None:
    """The kernel's row scales come from FP64 arithmetic (fp8_q_scale), not the pre-pass's
    __fdiv_rn / __frcp_rn: on 32,768 rows whose amax runs over every non-negative BF16 value
    (zero, subnormals, normals, the largest finite value, inf; the NaN patterns replaced by 0),
    the other channels random multiples of it, the scales are the pre-pass's bit for bit (those
    below 2^-126 flushed to 0 by both, SPEC 4.1) and so is the output (compared as bits: rows near
    the top of the BF16 range overflow to inf / NaN in both)."""
    from test_attention_fp8_mma_sync_gpu import prepare, run_kernel
    from test_attention_nvfp4_gpu import bounds_of

    tokens = 1 << 15
    bits = torch.arange(tokens, dtype=torch.int32, device="cuda")
    bits = torch.where(bits <= 0x7F80, bits, torch.zeros_like(bits))  # +0 .. +inf, no NaN
    amax = bits.to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator(device="cuda").manual_seed(3)
    u = torch.rand(tokens, 1, 128, generator=g, device="cuda") * 2 - 1
    q = (u * torch.where(torch.isinf(amax), 1.0, amax)[:, None, None]).to(torch.bfloat16)
    q[:, 0, 0] = amax.to(torch.bfloat16)
    k, v = make_qkv(tokens, 1, "gauss", seed=4)[1:]
    call = prepare(module, q.contiguous(), k, v, bounds_of([tokens]))
    base = run_kernel(module, call)
    scales = call.views["q_scales"].clone()
    call.views["q_scales"].fill_(math.nan)
    call.views["q_codes"].fill_(0x7F)
    variant = run_kernel(benchmark_build("fp8_wgmma", {"q_in_kernel": 1}), call)
    assert torch.equal(call.views["q_scales"].view(torch.int32), scales.view(torch.int32))
    assert torch.equal(variant.view(torch.int16), base.view(torch.int16))


@pytest.mark.parametrize(
    "flags", [{"ping_pong": False}, {"wait_sleep_ns": 0}, {"dynamic_schedule": False}],
    ids=["no-ping-pong", "polling-waits", "static-order"],
)
@pytest.mark.parametrize("bounds", BENCHMARK_BOUNDS, ids=BENCHMARK_IDS)
def test_nvfp4_benchmark_builds_match_production(
    flags: dict[str, Any], bounds: tuple[int, ...]
) -> None:
    """The NVFP4 kernel's benchmark-only builds that keep the arithmetic (no ping-pong; the
    producer warpgroup's waits polling; the static item order) give the production build's
    output bit for bit."""
    from flashinfer_h3.jit import get_module

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma NVFP4 kernel is a Hopper (compute capability 9.0) kernel")
    base, variant = kernel_only_outputs(
        "nvfp4", "wgmma_fp16_nvfp4",
        [get_module("nvfp4_wgmma"), benchmark_build("nvfp4_wgmma", flags)], bounds,
    )
    assert torch.isfinite(base).all()
    assert torch.equal(base, variant)


@pytest.mark.parametrize("bounds", BENCHMARK_BOUNDS, ids=BENCHMARK_IDS)
def test_nvfp4_fp32_rounding_build_is_close(bounds: tuple[int, ...]) -> None:
    """Production rounds each pair of y to FP16 and runs rn_e2m1 on the f16x2 pair
    (``kF16Rounding``); the ``f16_rounding=False`` build rounds the FP32 y. Both roundings are
    exact for their inputs, so a code differs only where y lies within half an FP16 ulp of an
    E2M1 tie (about 7e-4 of the P elements), by one grid step. Measured on the H200: rel L2
    8.1-8.5e-3 between the builds, a tenth of what the P quantisation itself changes (9.2e-2),
    against a bound of 0.02 to the reference. A wrong magic constant, exponent mask or half
    order moves whole groups (>= 5e-2)."""
    from flashinfer_h3.jit import get_module

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma NVFP4 kernel is a Hopper (compute capability 9.0) kernel")
    base, variant = kernel_only_outputs(
        "nvfp4", "wgmma_fp16_nvfp4",
        [get_module("nvfp4_wgmma"), benchmark_build("nvfp4_wgmma", {"f16_rounding": False})],
        bounds,
    )
    assert torch.isfinite(base).all() and torch.isfinite(variant).all()
    rel = ((base.float() - variant.float()).norm() / variant.float().norm()).item()
    print(f"f16 vs fp32 rounding: rel L2 {rel:.2e}")
    assert 0 < rel <= 0.015, rel


@pytest.mark.parametrize("bounds", BENCHMARK_BOUNDS, ids=BENCHMARK_IDS)
def test_nvfp4_unfolded_p_scale_build_is_close(bounds: tuple[int, ...]) -> None:
    """Production folds each P group's 1 / s into its exponentials (y = 2^(S c - bias - log2 s)
    instead of fl(Ptil * r)); the ``fold_p_scale=False`` build multiplies. The two y agree to the
    exponential's own approximation, so their E2M1 codes can differ only for y within a few ulp
    of a rounding tie: the outputs agree to far below the recipe's error (0.19), and on almost
    every element exactly. A wrong table entry, offset or row-sum weight moves whole groups
    (rel L2 >= 1e-2)."""
    from flashinfer_h3.jit import get_module

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma NVFP4 kernel is a Hopper (compute capability 9.0) kernel")
    base, variant = kernel_only_outputs(
        "nvfp4", "wgmma_fp16_nvfp4",
        [get_module("nvfp4_wgmma"), benchmark_build("nvfp4_wgmma", {"fold_p_scale": False})],
        bounds,
    )
    assert torch.isfinite(base).all() and torch.isfinite(variant).all()
    rel = ((base.float() - variant.float()).norm() / variant.float().norm()).item()
    assert rel <= 1e-3, rel
    assert (base != variant).float().mean().item() <= 0.01
