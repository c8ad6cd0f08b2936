#!/bin/bash
# TEMPORARY device run of the quantization pre-pass (deleted after use).
cd "$(dirname "$0")/.."
export FLASHINFER_H3_CACHE_DIR=/tmp/fcache
mkdir -p $FLASHINFER_H3_CACHE_DIR
step() { echo "$1 rc=$2 t=$SECONDS" >> $OUT/steps.log; }
nvidia-smi > $OUT/nvidia-smi.txt 2>&1
python3 -c "import torch, tvm_ffi, pytest; print(torch.__version__, tvm_ffi.__version__, pytest.__version__)" > $OUT/env.txt 2>&1
python3 benchmarks/_tmp_patch_formats.py /tmp/var > $OUT/patch.log 2>&1
export FLASHINFER_H3_TEST_QUANTIZE_STANDALONE=1
PT="python3 -m pytest -q -p no:cacheprovider -rf"
timeout 100 $PT --maxfail=40 --durations=8 tests/test_quantize_gpu.py > $OUT/test_default.log 2>&1; step tests $?
timeout 45 python3 benchmarks/bench_quantize.py --standalone --profile --json $OUT/bench_default.json > $OUT/bench_default.log 2>&1; step bench $?
for v in C B; do
  timeout 25 python3 benchmarks/bench_quantize.py --standalone --ops nvfp4 --include /tmp/var/var$v --json $OUT/bench_$v.json > $OUT/bench_$v.log 2>&1; step bench$v $?
done
FLASHINFER_H3_TEST_QUANTIZE_INCLUDE=/tmp/var/varC timeout 35 $PT --maxfail=5 tests/test_quantize_gpu.py -k "nvfp4 and (edge or random or heads or single)" > $OUT/test_C.log 2>&1; step testC $?
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ $SECONDS -lt 185 ]; then
  timeout $((220 - SECONDS)) $CS --tool memcheck --error-exitcode 9 $PT tests/test_quantize_gpu.py -k "edge_lengths and heavy or no_tokens or 64_heads" > $OUT/memcheck.log 2>&1; step memcheck $?
fi
if [ $SECONDS -lt 200 ]; then
  timeout $((224 - SECONDS)) $CS --tool racecheck --error-exitcode 9 $PT tests/test_quantize_gpu.py -k "edge_lengths and biased" > $OUT/racecheck.log 2>&1; step racecheck $?
fi
ls -la $FLASHINFER_H3_CACHE_DIR/quantize_standalone > $OUT/builds.txt 2>&1
cp $FLASHINFER_H3_CACHE_DIR/quantize_standalone/*.log $OUT/ 2>/dev/null
step done 0
