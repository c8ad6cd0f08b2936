#!/usr/bin/env bash
# One device session on an H200: every GPU test, the benchmarks and the sanitizers, logs in $OUT.
# Usage (from the repository root; the wheels in .whl/ -- apache-tvm-ffi cp312, cudnn-frontend, and
# sageattention 1.0.x, a pure-Python Triton package -- are installed into /tmp/site with --no-deps;
# .whl/ is git-ignored, so a device run must carry it):
#   REV=$(git rev-parse --short HEAD) OUT=/some/dir bash benchmarks/h200_session.sh [tests|bench|fp8|sanitize|profile|diagnose|ncu|mix|breakdown|prepass_sms|variants|against|l2|qin|energy|none|all|record]
# (profile: ncu of the quantization pre-pass kernels at 61,440 x 56; diagnose: what bounds the two
# Hopper attention kernels; ncu: diagnose's Nsight Compute part alone; mix: where h3-mix loses
# against h3-10s; breakdown: a whole call's pre-pass and kernel; prepass_sms: the pre-pass on a few
# SMs and beside the attention kernel; variants: benchmark builds against production; against:
# production against an earlier commit's build and benchmark builds, short segments too; l2:
# what re-reading a chunk from L2 saves; qin: the FP8 q_in_kernel build's tests and timings; energy:
# joules a call (bench_energy.py); none: only the setup (wheels, cache, info, warmup), for commands
# of one's own after it; see below; none of these is part of all; record: all, then what the
# NVFP4 P quantisation and softmax cost (benchmark builds, kernel alone): the Hopper issues'
# evidence in one call of ~8-9 minutes with BENCH_SIDE=0 TESTS_TIMEOUT=200 and a carried cache)
# A JIT cache built on the CPU can come along: `bash benchmarks/carry_cache.sh` builds .h3carry
# (production and the record's benchmark builds), carry .h3carry; it is copied into the session's cache.
set -uo pipefail
what=${1:-all}
modes=" tests bench fp8 sanitize profile diagnose ncu mix breakdown prepass_sms variants against l2 qin energy none all record "
if [[ $modes != *" $what "* ]]; then
    echo "h200_session.sh: unknown mode '$what'; expected one of:$modes" >&2
    exit 2
fi
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
# cudnn-frontend (the cuDNN FP8 peer) and torch must use one libcudnn: torch's comes first.
cudnn_lib=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2>/dev/null)
[[ -n $cudnn_lib ]] && export LD_LIBRARY_PATH=$cudnn_lib:${LD_LIBRARY_PATH:-}
# One JIT cache for every step, so each module is built once per session.
export FLASHINFER_H3_CACHE_DIR=${FLASHINFER_H3_CACHE_DIR:-/tmp/h3cache}
if [[ -d .h3carry ]]; then mkdir -p "$FLASHINFER_H3_CACHE_DIR" && cp -r .h3carry/. "$FLASHINFER_H3_CACHE_DIR"/; fi
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv
    # A device copy of the tree may carry a stale .git: the caller names the commit in REV.
    echo "commit ${REV:-unknown (set REV)}; .git says $(git log -1 --format=%h 2>/dev/null || echo none)"
    python3 -m flashinfer_h3 info
    # profile builds the pre-pass alone (--standalone), without the attention kernel.
    [[ $what == profile ]] || python3 -m flashinfer_h3 warmup
} 2>&1 | tee "$OUT/info.log"

if [[ $what == all || $what == record || $what == tests ]]; then
    # Every GPU test of the tree (marker gpu), 8 worker processes on the one GPU; the modules
    # were built by the warmup above into the shared FLASHINFER_H3_CACHE_DIR. -s: the kernels'
    # tests print their worst relative L2 against the reference.
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -rs -p no:cacheprovider -m gpu -n 8 tests/ \
        2>&1 | tail -n 60 | tee "$OUT/tests_gpu.log"
fi

if [[ $what == fp8 ]]; then
    # The FP8 operator's three presets with every peer (cuDNN FP8 when cudnn-frontend is there).
    timeout 240 python3 -m flashinfer_h3 bench --op fp8 --preset h3-10s,h3-15s-sp4,h3-mix \
        --iters 3 --json "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.log"
fi

if [[ $what == all || $what == record || $what == bench ]]; then
    {
        # BENCH_SIDE=0: the operators' bench alone (a bench of record when device time is short).
        if [[ ${BENCH_SIDE:-1} != 0 ]]; then
            timeout 90 python3 benchmarks/bench_quantize.py --profile --json "$OUT/bench_quantize.json"
            # The other presets' shapes: h3-15s-sp4 and h3-mix (six packed requests).
            timeout 90 python3 benchmarks/bench_quantize.py --tokens 92160 --heads 14
            timeout 90 python3 benchmarks/bench_quantize.py --heads 56 \
                --bounds 0 30720 46080 55296 59392 60928 61261
            timeout 60 python3 benchmarks/bench_host_overhead.py
        fi
        # Both operators (the default op set; a kernel backend also gets its "kernel only" row)
        # and every importable peer (SageAttention, cuDNN FP8) on the three MiniMax-H3 presets,
        # in one process: one JSON and one plot.
        # --rounds 3 (BENCH_ROUNDS): every row of a preset timed in turn three times (the GPU warms
        # up over a bench, and its clock under the 700 W cap with it: RESULTS.md, eighth session).
        # BENCH_PRESETS trims the presets when device time is short (h3-mix: both bars' closest).
        timeout ${BENCH_TIMEOUT:-420} python3 -m flashinfer_h3 bench \
            --preset "${BENCH_PRESETS:-h3-10s,h3-15s-sp4,h3-mix}" --iters "${BENCH_ITERS:-3}" --rounds "${BENCH_ROUNDS:-3}" \
            --json "$OUT/bench.json" --plot "$OUT/bench.png"
    } 2>&1 | tee "$OUT/bench.log"
fi

if [[ $what == all || $what == record || $what == sanitize ]]; then
    cat > /tmp/small_call.py <<'PY'
import os

import torch
from flashinfer_h3 import benchtools, varlen_attention_fp8, varlen_attention_nvfp4
bounds = [0, 1, 17, 17, 162, 300, 700, 1500]  # a segment of > 2 tiles reuses ring slots within an item
t = bounds[-1]
q, k, v = (torch.randn(t, 3, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
for op in (varlen_attention_nvfp4, varlen_attention_fp8):
    out = op(q, k, v, cu, cu_seqlens_host=bounds)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    print(op.__name__, "small packed call ok", tuple(out.shape))
# SAN_BUILDS="nvfp4:delta_mma_sync=1 fp8:kv_copies=0": benchmark builds of the Hopper kernels too,
# their pre-pass and kernel on the same call (built by the plain run below, outside the sanitizers).
for spec in os.environ.get("SAN_BUILDS", "").split():
    op, _, flags = spec.partition(":")
    ko = benchtools.kernel_only_build(op, benchtools.parse_build_flags(flags, op), q, k, v, bounds,
                                      torch.empty_like(q))
    ko.prime()
    out = ko.run()
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all() and ko.matches_whole_call(out)
    print(op, flags, "build: small packed call ok")
PY
    {
        # Once without a sanitizer: builds what SAN_BUILDS names (not on the sanitizers' clock)
        # and checks the script itself.
        timeout ${SAN_TIMEOUT:-150} python3 /tmp/small_call.py || echo "small call failed: exit $?"
        # SAN_TOOLS: a subset (e.g. racecheck alone for a new build's barriers).
        for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
            timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 python3 /tmp/small_call.py
            echo "compute-sanitizer $tool exit=$?"
        done
    } 2>&1 | tail -n 40 | tee "$OUT/sanitize.log"
fi

if [[ $what == profile ]]; then
    # Nsight Compute of the pre-pass kernels (one call of each op), clocks left alone. The report,
    # two text pages (details; per-SASS-instruction stall samples) and their stall summary
    # (benchmarks/ncu_stalls.py) land in $OUT.
    {
        timeout 400 ncu --clock-control none --set full --import-source no \
            -k 'regex:quantize_kernel' --launch-count 4 -f -o "$OUT/quantize" \
            python3 benchmarks/bench_quantize.py --standalone --iters 1 --warmup 0 --repeats 1
        ncu --import "$OUT/quantize.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
        ncu --import "$OUT/quantize.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/ncu_sass.csv" 2>&1
        python3 benchmarks/ncu_stalls.py "$OUT/ncu_sass.csv" > "$OUT/ncu_stalls.txt"
        ls -la "$OUT"
        timeout 120 python3 benchmarks/bench_quantize.py --standalone --profile --json "$OUT/bench_quantize.json"
    } 2>&1 | tee "$OUT/profile.log"
fi

if [[ $what == mix ]]; then
    # Where h3-mix loses against h3-10s (both kernels, kernel only, production builds): h3-mix
    # itself, then each of its six segment lengths as a ~61k-token shape of its own (many equal
    # segments, so the last wave is a small share), 56 heads. The mix's time predicted from the
    # per-length throughputs, against its measured time, is the cost of packing different
    # lengths into one launch (the static schedule's imbalance); the per-length throughputs are
    # the cost of short segments (per-item prologue and epilogue, masked tiles).
    timeout 300 python3 benchmarks/bench_wgmma_variants.py --op fp8,nvfp4 --preset h3-mix \
        --shape 30720*2:56 --shape 15360*4:56 --shape 9216*7:56 --shape 4096*15:56 \
        --shape 1536*40:56 --shape 333*184:56 --only none --iters 5 --rounds 3 2>&1 | tee "$OUT/mix.log"
fi

if [[ $what == breakdown ]]; then
    # Where a whole call's time goes (pre-pass, attention kernel, each alone and inside one call
    # sequence) beside cuDNN BF16, both operators, the three presets; FP8_BUILD (one build, e.g.
    # q_in_kernel=1) adds a benchmark build of the FP8 module's rows.
    timeout 300 python3 benchmarks/bench_call_breakdown.py --op fp8,nvfp4 \
        --preset h3-10s,h3-15s-sp4,h3-mix --iters 10 --rounds 3 --fp8-build "${FP8_BUILD:-}" \
        2>&1 | tee "$OUT/breakdown.log"
fi

if [[ $what == qin ]]; then
    # Q quantised inside the FP8 kernel (benchmark builds q_in_kernel=1 and 2, twentieth
    # session): their GPU tests, then each build's call (its pre-pass without Q, then its kernel)
    # against production's, the three presets in 5 interleaved rounds ("in call: both" rows),
    # then the L2 reuse that decides the single-pass pre-pass. About 6 minutes with a carried
    # JIT cache.
    {
        timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -x \
            -k "q_quantised or q-in-kernel or every_bf16_magnitude" \
            tests/kernels/test_attention_fp8_wgmma_gpu.py 2>&1 | tail -n 15
        timeout 300 python3 benchmarks/bench_call_breakdown.py --op fp8 \
            --preset h3-mix,h3-10s,h3-15s-sp4 --iters 10 --rounds 5 \
            --fp8-build q_in_kernel=1 --fp8-build q_in_kernel=2
        timeout 100 python3 benchmarks/bench_l2_reuse.py
    } 2>&1 | tee "$OUT/qin.log"
fi

if [[ $what == l2 ]]; then
    # What re-reading each chunk of a 1 GiB buffer right after its first read saves against a
    # second DRAM read, by chunk size: what a single pass over K and V in the pre-pass could save.
    timeout 200 python3 benchmarks/bench_l2_reuse.py 2>&1 | tee "$OUT/l2_reuse.log"
fi

if [[ $what == energy ]]; then
    # Joules a call (benchmarks/bench_energy.py): both operators' whole calls, pre-passes and
    # kernels, cuDNN BF16, and the benchmark builds ENERGY_BUILDS names (bench_energy.py options,
    # e.g. "--nvfp4-build delta=0 --fp8-build kv_copies=0"; build them into a carried cache).
    read -ra energy_builds <<< "${ENERGY_BUILDS:-}"
    timeout "${ENERGY_TIMEOUT:-300}" python3 benchmarks/bench_energy.py \
        --preset "${ENERGY_PRESETS:-h3-10s,h3-mix}" --seconds "${ENERGY_SECONDS:-2.5}" \
        --rounds "${ENERGY_ROUNDS:-2}" "${energy_builds[@]}" 2>&1 | tee "$OUT/energy.log"
fi

if [[ $what == record ]]; then
    # The cost of the NVFP4 P quantisation (and of the whole softmax) on this tree's kernel:
    # production against the quantize_p=False and softmax=False benchmark builds, kernel alone.
    timeout 200 python3 benchmarks/bench_wgmma_variants.py --op nvfp4 --preset h3-10s,h3-mix \
        --only "P not quantised,no softmax (S" --iters 5 --rounds 3 2>&1 | tee "$OUT/p_cost.log"
fi

if [[ $what == variants ]]; then
    # Benchmark-only builds against production, kernel only, the three presets, one process
    # (VARIANT_OP: fp8 or nvfp4; VARIANT_ONLY: bench_wgmma_variants.py --only), after the GPU
    # tests that VARIANT_TESTS selects (pytest -k) in that op's wgmma kernel files (e.g. nvfp4 with
    # VARIANT_TESTS=delta_forms: the NVFP4 delta builds' file).
    {
        if [[ -n ${VARIANT_TESTS:-} ]]; then
            timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -x -k "$VARIANT_TESTS" \
                tests/kernels/test_attention_"${VARIANT_OP:-fp8}"_wgmma*_gpu.py 2>&1 | tail -n 15
        fi
        timeout 400 python3 benchmarks/bench_wgmma_variants.py --op "${VARIANT_OP:-fp8}" \
            --preset h3-10s,h3-mix,h3-15s-sp4 --only "${VARIANT_ONLY:-none}" --iters 5 --rounds 3 --oracle
    } 2>&1 | tee "$OUT/variants.log"
fi

if [[ $what == against ]]; then
    # Production against other builds of the same module, kernel only, in one process: an
    # earlier commit's production .so (AGAINST_FP8 / AGAINST_NVFP4, carried), and the FP8
    # benchmark builds that AGAINST_ONLY selects (bench_wgmma_variants.py --only); h3-mix, h3-10s
    # and short segments (AGAINST_SHAPES). Each row prints its rel L2 against production and the
    # share of output elements that differ (0: the same numbers).
    {
        [[ -n ${AGAINST_FP8:-}${AGAINST_NVFP4:-} ]] || echo "against: set AGAINST_FP8 and/or AGAINST_NVFP4 to a .so"
        shapes=()
        read -ra listed <<< "${AGAINST_SHAPES:-184*333:56 1536*40:56}"  # no glob expansion of the *
        for s in "${listed[@]}"; do shapes+=(--shape "$s"); done
        [[ -z ${AGAINST_FP8:-} ]] || timeout 300 python3 benchmarks/bench_wgmma_variants.py --op fp8 \
            --preset h3-mix,h3-10s "${shapes[@]}" --only "${AGAINST_ONLY:-none}" --so "fp8=$AGAINST_FP8" \
            --iters 5 --rounds 3
        [[ -z ${AGAINST_NVFP4:-} ]] || timeout 300 python3 benchmarks/bench_wgmma_variants.py --op nvfp4 \
            --preset h3-mix,h3-10s "${shapes[@]}" --only none --so "nvfp4=$AGAINST_NVFP4" --iters 5 --rounds 3
    } 2>&1 | tee "$OUT/against.log"
fi

if [[ $what == prepass_sms ]]; then
    # The pre-pass on a few SMs (benchmark builds prepass_ctas=N) and beside the attention kernel
    # on a side stream: what overlapping it with the kernel could save (issues 11 and 12, h3-mix).
    timeout 400 python3 benchmarks/bench_prepass_sms.py --op nvfp4,fp8 --preset h3-mix,h3-10s \
        --ctas "${PREPASS_CTAS:-16,32,66}" --iters 5 --rounds 3 2>&1 | tee "$OUT/prepass_sms.log"
fi

if [[ $what == diagnose || $what == ncu ]]; then
  if [[ $what == diagnose ]]; then
    # What bounds the Hopper attention kernels (issues 11 and 12), in one call of about two
    # minutes when the JIT cache comes along: build it on the CPU first and carry it (the
    # modules' .o files stay behind: the carry is limited to 64 MiB), e.g.
    #   export FLASHINFER_H3_CACHE_DIR=$PWD/build/h3carry
    #   python -m flashinfer_h3 warmup --arch sm_90a
    #   python benchmarks/bench_wgmma_variants.py --build-only --only "no softmax,no O,polling"
    #   find build/h3carry -name '*.o' -delete
    # and on the device: mkdir -p /tmp/h3cache && cp -r build/h3carry/. /tmp/h3cache/ first.
    # 1. the cycle microbenchmarks of their parts on resident operands (benchmarks/sm90_pipes.cu);
    # 2. at h3-10s, the FP8 kernel without its softmax and without its O update (the pipeline
    #    floor and the two-level accumulation's cost; the NVFP4 floors are in RESULTS.md) and
    #    both kernels with the producer warpgroup's waits polling; the GPU tests of the builds
    #    that keep the arithmetic against production first;
    # 3. Nsight Compute source counters of both production kernels at 16,384 x 16 (stall
    #    summaries; the per-instruction CSVs compressed).
    {
        nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I templates/include \
            benchmarks/sm90_pipes.cu -o /tmp/sm90_pipes && /tmp/sm90_pipes --json "$OUT/pipes.json"
    } 2>&1 | tee "$OUT/pipes.log"
    {
        timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -s \
            -k "benchmark_builds" tests/kernels/test_attention_fp8_wgmma_gpu.py 2>&1 | tail -n 25
        timeout 240 python3 benchmarks/bench_wgmma_variants.py --op fp8,nvfp4 --preset h3-10s \
            --only "no softmax,no O,polling" --iters 5 --rounds 3
    } 2>&1 | tee "$OUT/variants.log"
  fi
    for op in fp8 nvfp4; do
        timeout 200 ncu --kernel-name-base demangled -k "regex:attention_${op}_wgmma_kernel" \
            --launch-count 1 --set full --import-source no -f -o "/tmp/$op" \
            python3 benchmarks/bench_wgmma_variants.py --op "$op" --preset "" --shape 16384:16 \
            --only none --iters 1 --rounds 1 > "/tmp/ncu_$op.log" 2>&1
        ncu --import "/tmp/$op.ncu-rep" --page source --csv --print-source sass > "/tmp/${op}_src.csv" 2>&1
        mkdir -p /tmp/ncu_pages
        cp "/tmp/${op}_src.csv" /tmp/ncu_pages/
        ncu --import "/tmp/$op.ncu-rep" --page details > "/tmp/ncu_pages/${op}_details.txt" 2>&1
        ncu --import "/tmp/$op.ncu-rep" --page raw --csv > "/tmp/ncu_pages/${op}_raw.csv" 2>&1
        {
            tail -n 5 "/tmp/ncu_$op.log"
            ncu --import "/tmp/$op.ncu-rep" --page details 2>&1 | grep -E "Duration|SM Frequency|Issue Slots Busy|Tensor|Pipe|Warp Cycles|Eligible|Registers|Throughput" | head -40
            python3 benchmarks/ncu_stalls.py "/tmp/${op}_src.csv" --top 40
        } > "$OUT/${op}_stalls.txt" 2>&1
    done
    # One archive of the pages (source CSVs, details, raw metrics): a device run returns 8 files.
    tar -czf "$OUT/ncu_pages.tgz" -C /tmp ncu_pages
    ls -la "$OUT"
fi
