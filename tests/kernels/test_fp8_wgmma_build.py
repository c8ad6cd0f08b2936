"""CPU checks of the Hopper wgmma FP8 kernel's compiled form (module ``fp8_wgmma``, sm_90a).

Built through the JIT (no GPU needed; nvcc and cuobjdump are), read back from the binary:

- both products on the FP8 wgmma: 16 ``QGMMA.64x128x32.F32.E4M3.E4M3`` with both operands in
  shared memory (QK^T of a 256-key tile's two halves, 4 k32 steps each, in the first phase and
  in the loop) and 16 with A = P from registers (PV, 8 k32 steps, in the loop and in the last
  phase) per consumer warpgroup's code path (the two consumers are separate instantiations), no
  HGMMA/HMMA;
- the roles' register split (``USETMAXREG``), 384 threads, one CTA per SM of shared memory;
- no local memory: 0 bytes of stack frame and of spill stores / loads in ptxas' report, STACK and
  LOCAL 0 in the resource usage, no LDL / STL in the SASS. The consumers' 240 registers fit only
  because S, Otmp and P share registers (fp8_kernel.cuh consume_256), so a value newly held
  across the tile loop shows up here;
- the producer's waits suspend (``NANOSLEEP.SYNCS`` after a failed ``TRYWAIT``);
- no wgmma serialised.

The benchmark-only builds without the softmax or the O update (128-key tiles) keep all their
GEMMs, and the 128-key build (production until 2026-12-02) has no local memory either.
"""

from __future__ import annotations

import re
from pathlib import Path

import binary_tools as bt
import pytest

pytestmark = pytest.mark.nvcc

KERNEL = "attention_fp8_wgmma_kernel"
QGMMA = "QGMMA.64x128x32.F32.E4M3.E4M3"
MAX_SMEM = 227 * 1024  # H100/H200 opt-in per block


@pytest.fixture(scope="module")
def so() -> Path:
    from flashinfer_h3.jit import KernelConfig, build_module

    return Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a")))


def test_both_products_on_fp8_wgmma(so: Path) -> None:
    sass = bt.sass(so, KERNEL)
    ss = [line for line in sass.splitlines() if QGMMA in line and "gdesc" in line.split(QGMMA)[1]
          and re.search(QGMMA + r" R\d+, gdesc", line)]
    rs = [line for line in sass.splitlines() if re.search(QGMMA + r" R\d+, R\d+, gdesc", line)]
    print(f"{KERNEL}: {len(ss)} SS (QK^T) and {len(rs)} RS (PV) FP8 wgmma")
    # Each consumer instantiation: QK^T (two halves of 4 k32 steps) in the first phase and in
    # the loop, PV (8 k32 steps) in the loop and in the last phase.
    assert len(ss) == 2 * 2 * 8 and len(rs) == 2 * 2 * 8
    assert "HGMMA" not in sass and "HMMA" not in sass
    assert "USETMAXREG" in sass


def test_wgmma_asynchronous(so: Path) -> None:
    """ptxas keeps the wgmmas asynchronous: one ``WARPGROUP.ARRIVE`` per GEMM issue (6 a
    consumer: QK^T's two halves in the first phase, PV and the two halves in the loop, PV in
    the last phase). A register shortage around the wgmmas makes ptxas serialise every one of them
    (warning C7511, "insufficient register resources for the wgmma pipeline") with an arrive
    each, and ptxas still reports no spills: a softmax change that touches the accumulators'
    registers can do that (a first integer form of the row maxima did)."""
    assert bt.sass(so, KERNEL).count("WARPGROUP.ARRIVE") == 2 * 6


def test_resources(so: Path) -> None:
    bt.assert_no_local_memory(so, KERNEL)
    smem = int(bt.load(so).attention_fp8_wgmma_smem_bytes())
    assert 0 < smem <= MAX_SMEM
    # No L2 prefetch of its own (the removed prefetch_next_item build's UBLKPF; UTMAPF: the
    # tensor-map form).
    sass = bt.sass(so, KERNEL)
    assert "UBLKPF" not in sass and "UTMAPF" not in sass


def test_module_is_hopper_only() -> None:
    from flashinfer_h3.jit import KernelConfig

    with pytest.raises(ValueError, match="sm_90a"):
        KernelConfig("fp8_wgmma", arch="sm_120a")


T128 = {"tile_keys": 128, "poly_exp2_every": 32}


@pytest.mark.parametrize(
    "flags", [{**T128, "softmax": False}, {**T128, "o_update": False}],
    ids=["no-softmax", "no-o-update"],
)
def test_benchmark_builds_keep_every_gemm(flags: dict[str, int]) -> None:
    """The benchmark-only builds that drop a part of the consumer's work still run all 32 full
    FP8 wgmmas, 16 of them (PV) with A from registers (ptxas replaces a wgmma whose accumulators
    nothing reads by an empty ``HGMMA.64x8x16 RZ``, which would time a kernel without that GEMM),
    and have no local memory (else they would time their spills)."""
    from flashinfer_h3.jit import KernelConfig, build_module

    so = Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a", flags=flags)))
    sass = bt.sass(so, KERNEL)
    assert len(re.findall(QGMMA, sass)) == 32
    assert "HGMMA" not in sass
    bt.assert_no_local_memory(so, KERNEL)
    rs = re.findall(QGMMA + r" R\d+, R\d+, gdesc", sass)
    assert len(rs) == 16


def test_dynamic_item_order(so: Path) -> None:
    """Production strides statically over the items (no atomic); the ``dynamic_schedule=True``
    benchmark build draws them from the workspace counter (one ``ATOM.E.ADD`` of the producer
    thread) and, like production, has no local memory (the producer's 24 registers are the
    tight part)."""
    from flashinfer_h3.jit import KernelConfig, build_module

    assert "ATOM" not in bt.sass(so, KERNEL)
    config = KernelConfig("fp8_wgmma", arch="sm_90a", flags={**T128, "dynamic_schedule": True})
    dynamic = Path(build_module(config))
    assert len(re.findall(r"\bATOMG?\.E\.ADD", bt.sass(dynamic, KERNEL))) == 1
    bt.assert_no_local_memory(dynamic, KERNEL)


def test_producer_waits_suspend(so: Path) -> None:
    """The producer's waits for a free ring slot carry try_wait's suspend-time hint
    (``NANOSLEEP.SYNCS`` after the ``TRYWAIT`` that failed) instead of polling; the
    ``wait_sleep_ns=0`` benchmark build polls (no sleep)."""
    from flashinfer_h3.jit import KernelConfig, build_module

    assert re.search(r"NANOSLEEP\.SYNCS 0x64\b", bt.sass(so, KERNEL))  # 100 ns
    config = KernelConfig("fp8_wgmma", arch="sm_90a", flags={"wait_sleep_ns": 0})
    polling = Path(build_module(config))
    assert "NANOSLEEP" not in bt.sass(polling, KERNEL)


def test_128_key_build() -> None:
    """The 128-key tiles (``tile_keys=128``, production until 2026-12-02): 8 SS and 8 RS wgmmas
    a consumer, asynchronous, no local memory."""
    from flashinfer_h3.jit import KernelConfig, build_module

    so = Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a", flags=T128)))
    sass = bt.sass(so, KERNEL)
    assert len(re.findall(QGMMA + r" R\d+, gdesc", sass)) == 16
    assert len(re.findall(QGMMA + r" R\d+, R\d+, gdesc", sass)) == 16
    assert sass.count("WARPGROUP.ARRIVE") == 2 * 4
    bt.assert_no_local_memory(so, KERNEL)


def test_p_packed_as_its_exponentials_complete(so: Path) -> None:
    """Production packs P into the PV operand as its exponentials complete (fp8_softmax.cuh
    fp8_exp_half), in the issue slots the MUFU-bound tail of the exponentials leaves free: a
    steady-state tile's path (benchmarks/sass_tile_loop.py) encodes fewer stall cycles than that
    of the ``interleaved_pack=False`` build (production until 2026-12-07), which packs after the
    last exponential (forty-first session: 1,846 against 2,011; 2 % faster on the H100, the same
    output). That build keeps all 64 FP8 wgmmas (both consumers' code) asynchronous and has no
    local memory."""
    from flashinfer_h3.jit import KernelConfig, build_module

    after = Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a",
                                           flags={"interleaved_pack": False})))
    sass = bt.sass(after, KERNEL)
    assert len(re.findall(QGMMA, sass)) == 64
    assert sass.count("WARPGROUP.ARRIVE") == 2 * 6
    bt.assert_no_local_memory(after, KERNEL)
    tool = bt.sass_tile_loop()
    production = tool.consumer_loops(bt.sass(so, KERNEL))
    packed_after = tool.consumer_loops(sass)
    print("a tile's path stall cycles: production", [lp.path_stall_cycles for lp in production],
          "P packed after", [lp.path_stall_cycles for lp in packed_after])
    assert len(production) == len(packed_after) == 2
    for a, b in zip(production, packed_after, strict=True):
        assert a.path_stall_cycles < b.path_stall_cycles


def test_tile_path_by_opcode(so: Path) -> None:
    """benchmarks/sass_tile_loop.py --opcodes: a steady-state tile's path by opcode holds the
    exponentials production places on MUFU: per thread and 256-key tile, 128 of them less the 2
    the default poly_exp2_every = 64 puts on the FMA pipe, and the two rows' rescales (alpha),
    128 MUFU.EX2; 2 x 64 maxima (FMNMX) at least; 64 E4M3 pair packs."""
    tool = bt.sass_tile_loop()
    for loop in tool.consumer_loops(bt.sass(so, KERNEL)):
        ops = loop.path_opcodes
        print({op: nc for op, nc in ops.items() if nc[1] >= 40})
        assert ops["MUFU.EX2"][0] == 128 - 2 + 2
        assert ops["FMNMX"][0] >= 128
        assert ops["F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"][0] == 64


def test_256_key_tiles_refuse_the_dynamic_order() -> None:
    """The 256-key consumers stride statically; a build asking for the dynamic item order with
    them (whose producer would draw items the consumers never take) fails to compile."""
    from flashinfer_h3.jit import KernelConfig, build_module

    with pytest.raises(Exception, match="static item order only"):
        build_module(KernelConfig("fp8_wgmma", arch="sm_90a", flags={"dynamic_schedule": True}))


def test_clustered_build_shares_the_tile_copies(so: Path) -> None:
    """Production copies each CTA's K and V tiles itself (plain ``UTMALDG.3D``, no cluster) and
    its binding says 1 CTA a cluster. The ``cluster_ctas=2`` benchmark build runs clusters of two
    CTAs on pairs of query blocks: the producer copies its half of every K and V tile into both
    CTAs (``UTMALDG.3D.MULTICAST``, one K and one V copy in its rolled tile loop), the CTAs meet on
    the cluster barrier (``UCGABAR``) before the copies start and before the producer warpgroup
    lets its CTA exit, the consumers free a slot in both CTAs without a GPU-scope fence (a
    ``MEMBAR.ALL.GPU`` before each remote arrival cost 17 %), and there is no local memory; 128-key
    tiles refuse clusters."""
    from flashinfer_h3.jit import KernelConfig, build_module

    sass = bt.sass(so, KERNEL)
    assert "MULTICAST" not in sass and "UCGABAR" not in sass
    assert int(bt.load(so).attention_fp8_wgmma_cluster_ctas()) == 1
    pair = Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a", flags={"cluster_ctas": 2})))
    pair_sass = bt.sass(pair, KERNEL)
    assert len(re.findall(r"UTMALDG\.3D\.MULTICAST", pair_sass)) == 2
    assert "UCGABAR_ARV" in pair_sass and "UCGABAR_WAIT" in pair_sass
    # The two cluster barriers' releases only (kernel start, the producer warpgroup's end).
    assert pair_sass.count("MEMBAR.ALL.GPU") == 2
    assert int(bt.load(pair).attention_fp8_wgmma_cluster_ctas()) == 2
    bt.assert_no_local_memory(pair, KERNEL)
    with pytest.raises(Exception, match="clusters of two CTAs"):
        build_module(KernelConfig("fp8_wgmma", arch="sm_90a", flags={**T128, "cluster_ctas": 2}))


def test_removed_prefetch_build_is_refused() -> None:
    """``prefetch_next_item`` (measured and removed after 2ecf91a, fp8_kernel.cuh produce) is
    refused by name before any compile, so an old benchmark command fails instead of timing
    production under its label."""
    from flashinfer_h3.jit import KernelConfig

    with pytest.raises(ValueError, match="prefetch_next_item"):
        KernelConfig("fp8_wgmma", arch="sm_90a", flags={"prefetch_next_item": True})


@pytest.mark.parametrize("mode", [1, 2], ids=["streaming", "skipped"])
def test_background_traffic_build(so: Path, mode: int) -> None:
    """``background_traffic`` (sm90/background_traffic.cuh): warps 1-3 of the producer warpgroup
    stream 16-byte loads and stores with the streaming cache operator (``LDG.E.EF.128``,
    ``STG.E.EF.128``: two loads in each of the three pass loops, the two stores of the passes that
    write), which production has none of; production's GEMMs, all asynchronous. Mode 2 is the same
    code behind a run-time condition. (The TMA thread, at 24 registers, spills beside this code:
    both modes carry that, so their difference is the traffic's.)"""
    from flashinfer_h3.jit import KernelConfig, build_module

    production = bt.sass(so, KERNEL)
    assert "LDG.E.EF.128" not in production and "STG.E.EF.128" not in production
    build = Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a",
                                           flags={"background_traffic": mode})))
    sass = bt.sass(build, KERNEL)
    assert sass.count("LDG.E.EF.128") == 6 and sass.count("STG.E.EF.128") == 2
    ss = QGMMA + r" R\d+, gdesc"
    assert len(re.findall(ss, sass)) == len(re.findall(ss, production))
    assert sass.count("WARPGROUP.ARRIVE") == production.count("WARPGROUP.ARRIVE")
    with pytest.raises(Exception, match="background_traffic"):
        build_module(KernelConfig("fp8_wgmma", arch="sm_90a",
                                  flags={"background_traffic": 1, "q_in_kernel": 1}))


@pytest.mark.parametrize("flags", [{"q_in_kernel": 1}, {"q_in_kernel": 1, "cluster_ctas": 2},
                                   {"q_in_kernel": 2}],
                         ids=["q-in-kernel", "q-in-kernel-clusters", "q-in-kernel-per-consumer"])
def test_q_in_kernel_build(so: Path, flags: dict[str, object]) -> None:
    """The ``q_in_kernel`` benchmark build (sm90/fp8_q_quantizer.cuh: warps 1-3 of the producer
    warpgroup quantise each Q block from the BF16 q) keeps production's GEMMs, all asynchronous,
    asks for production's shared memory plus the Q staging area (two 16 KB BF16 atoms, the rows'
    amax and reciprocals, two barriers; 34 KB with its alignment), computes the scales in FP64
    (``MUFU.RCP64H``, ``F2F.F32.F64``: no division slow-path call, whose stack frame the
    producer warpgroup's 24 registers cannot hold) and has no local memory."""
    from flashinfer_h3.jit import KernelConfig, build_module

    build = Path(build_module(KernelConfig("fp8_wgmma", arch="sm_90a", flags=flags)))
    sass = bt.sass(build, KERNEL)
    assert len(re.findall(QGMMA + r" R\d+, gdesc", sass)) == 32
    assert len(re.findall(QGMMA + r" R\d+, R\d+, gdesc", sass)) == 32
    assert sass.count("WARPGROUP.ARRIVE") == 2 * 6
    assert "MUFU.RCP64H" in sass and "F2F.F32.F64" in sass
    bt.assert_no_local_memory(build, KERNEL)
    extra = int(bt.load(build).attention_fp8_wgmma_smem_bytes())
    if "cluster_ctas" not in flags:
        extra -= int(bt.load(so).attention_fp8_wgmma_smem_bytes())
        assert extra == 34 * 1024
    assert int(bt.load(build).attention_fp8_wgmma_smem_bytes()) <= MAX_SMEM
