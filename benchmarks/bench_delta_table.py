"""The NVFP4 Hopper kernel's delta table (benchmark build ``delta_table=True``) against production,
in one process: where a call's time goes when the delta of every (query block, K tile) pair is
written by a kernel of its own before the attention kernel, instead of computed per tile by the
attention kernel's delta warpgroup.

Rows (median of CUDA-event timings over ``--rounds`` rounds, each timing every row in turn after
``--warmup-ms`` of untimed calls; SM clock and board power sampled meanwhile):

- production: the attention kernel alone (its pre-pass ran once before);
- per table build (the TMA thread prefetching the delta rows to L2 some tiles ahead, or not): the
  table kernels (qbar's parts, then the table) and the attention kernel
  (what the build's ``attention_only`` runs), the table kernel alone, the attention kernel alone
  on the table;
- the pre-pass alone (production's), for the whole call's arithmetic.

Each table build's output is compared with production's (the same products in the same order:
identical, or the build is wrong), and the table's size is printed (4 bytes a (block, position)
pair, per head). ``--check`` adds small packed shapes (empty, 1-token, 129, 4097-token and 17-token
segments) compared the same way; ``--delta-off`` adds the ``delta=False`` benchmark build's
attention kernel (the delta warpgroup writes the mask only: what the products cost in place).

    python benchmarks/bench_delta_table.py [--preset h3-mix,h3-10s] [--iters 5] [--rounds 3]
        [--warmup-ms 1000] [--check] [--delta-off] [--builds SUBSTRING,...]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from bench_wgmma_variants import timed_with_clocks  # this directory's script

from flashinfer_h3.__main__ import PRESETS, _non_negative_float, attention_flops
from flashinfer_h3.backends import delta_table_buffers
from flashinfer_h3.benchtools import (
    Timed,
    bench_shapes,
    kernel_only_build,
    round_order,
    rounds_summary,
)
from flashinfer_h3.jit import KernelConfig, build_module
from flashinfer_h3.jit.load import load_so

TABLE_BUILDS = {
    "delta table": {"delta_table": True},
    "delta table, rows prefetched 8 tiles ahead": {"delta_table": True, "table_prefetch": 8},
    "delta table, rows prefetched 32 tiles ahead": {"delta_table": True, "table_prefetch": 32},
}


def inputs(lengths: tuple[int, ...], heads: int, seed: int = 0) -> tuple[Any, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), heads, 128, generator=g, device="cuda").bfloat16()
               for _ in range(3))
    bounds = tuple(int(x) for x in torch.tensor((0, *lengths)).cumsum(0).tolist())
    return q, k, v, bounds


Fn = Callable[[], None]


def table_parts(flags: dict[str, Any], ko: Any) -> tuple[Fn, Fn, int]:
    """The table kernel alone and the attention kernel alone of a primed table build ``ko`` (on a
    table of their own), and the table's bytes."""
    module = load_so(build_module(KernelConfig("nvfp4_wgmma", arch="sm_90a", flags=flags)))
    _, qbar, q_f16, k_f16, v_f16, counter = ko.views
    seg_bounds, vkey_start, qblock_start, qblocks = ko.plan.args
    table, start, parts = delta_table_buffers(ko.plan.host.qblock_start, ko.q.shape[1],
                                              ko.q.device)
    used = ko.plan.host.vkey_start[-1]

    def fill() -> None:
        module.nvfp4_delta_table(table, start, parts, qbar, k_f16, seg_bounds, vkey_start,
                                 qblock_start)

    def attend() -> None:
        module.attention_nvfp4_wgmma_delta_table(ko.out, table, start, qbar, q_f16, k_f16, v_f16,
                                                 seg_bounds, vkey_start, qblock_start, qblocks,
                                                 counter, ko.scale, used)

    fill()
    return fill, attend, table.numel() * 4


def compare(name: str, got: Any, expected: Any) -> str:
    same = bool(torch.equal(got, expected))
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    finite = bool(torch.isfinite(got).all())
    verdict = "identical" if same else "DIFFERS"
    return f"{name}: {verdict} to production (rel L2 {rel:.2e}, finite {finite})"


def check_small() -> None:
    for lengths, heads in [((1, 129, 0, 700), 3), ((4097,), 2), ((17,) * 40, 5), ((1000, 537), 4)]:
        q, k, v, bounds = inputs(lengths, heads, seed=sum(lengths) + heads)
        out = torch.empty_like(q)
        prod = kernel_only_build("nvfp4", {}, q, k, v, bounds, out)
        prod.prime()
        expected = prod.run().clone()
        for name, flags in TABLE_BUILDS.items():
            ko = kernel_only_build("nvfp4", flags, q, k, v, bounds, out)
            ko.prime()
            whole = "identical" if torch.equal(ko.whole_call, expected) else "DIFFERS"
            print(f"check {lengths[:6]}{'...' if len(lengths) > 6 else ''} x {heads}: "
                  f"{compare(name, ko.run().clone(), expected)}; whole call {whole}", flush=True)


def run(preset: str, lengths: tuple[int, ...], heads: int, iters: int, rounds: int,
        warmup_ms: float, delta_off: bool = False, builds: str | None = None) -> None:
    q, k, v, bounds = inputs(lengths, heads)
    out = torch.empty_like(q)
    prod = kernel_only_build("nvfp4", {}, q, k, v, bounds, out)
    prod.prime()
    expected = prod.run().clone()
    rows: list[tuple[str, Callable[[], Any]]] = [("production: attention kernel", prod.run)]
    notes = []
    if delta_off:
        off = kernel_only_build("nvfp4", {"delta": False}, q, k, v, bounds, out)
        off.prime()
        off.run()
        rows.append(("benchmark build delta=False (no delta products; not attention)", off.run))
    for name, flags in TABLE_BUILDS.items():
        if builds and not any(part in name for part in builds.split(",")):
            continue
        ko = kernel_only_build("nvfp4", flags, q, k, v, bounds, out)
        ko.prime()
        notes.append(compare(name, ko.run().clone(), expected))
        fill, attend, nbytes = table_parts(flags, ko)
        attend()
        notes.append(compare(f"{name} (parts)", out.clone(), expected)
                     + f"; table {nbytes / 2**30:.2f} GiB")
        rows += [(f"{name}: table + attention", ko.run), (f"{name}: table kernel", fill),
                 (f"{name}: attention on the table", attend)]
    prepass = prod.prepared.launch.prepass_only
    rows.append(("production pre-pass", lambda: prepass(q, k, v, out, prod.scale, prod.bounds,
                                                        prod.plan, prod.views)))
    for note in notes:
        print(f"nvfp4 {preset}: {note}", flush=True)
    times: list[list[Timed]] = [[] for _ in rows]
    for r in range(rounds):
        for i in round_order(len(rows), r):
            times[i].append(timed_with_clocks(rows[i][1], iters, warmup_ms))
    flops = attention_flops(lengths, heads)
    for (name, _), measured in zip(rows, times, strict=True):
        ms, spread, clocks = rounds_summary(measured)
        print(f"nvfp4 {preset} ({sum(lengths)} x {heads}): {name}: {ms:.3f} ms (rounds spread "
              f"{100 * spread:.1f} %), {flops / ms / 1e9:.1f} TFLOP/s{clocks}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="h3-mix,h3-10s", help=f"among {', '.join(PRESETS)}")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=_non_negative_float, default=1000.0)
    ap.add_argument("--check", action="store_true", help="also compare on small packed shapes")
    ap.add_argument("--delta-off", action="store_true",
                    help="also time the delta=False benchmark build's attention kernel (no delta "
                    "products, the mask only)")
    ap.add_argument("--builds", default=None,
                    help="only the table builds whose name contains one of these comma-separated "
                    "substrings")
    args = ap.parse_args()
    if args.check:
        check_small()
    for name, lengths, heads in bench_shapes(args.preset, [], PRESETS):
        run(name, lengths, heads, args.iters, args.rounds, args.warmup_ms, args.delta_off,
            args.builds)


if __name__ == "__main__":
    main()
