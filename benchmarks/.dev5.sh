set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p /tmp/h3cache && cp -r build/h3carry/. /tmp/h3cache/ && export FLASHINFER_H3_CACHE_DIR=/tmp/h3cache
timeout 300 python3 benchmarks/bench_wgmma_variants.py --op fp8,nvfp4 --preset h3-10s,h3-15s-sp4,h3-mix --iters 5 --rounds 4 --only "all exp2" --so fp8=build/h3prev/fp8_wgmma_before.so --so nvfp4=build/h3prev/nvfp4_wgmma_before.so 2>&1 | grep -v compil | tee $OUT/variants.log
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m gpu -n 8 tests/kernels/test_attention_fp8_wgmma_gpu.py tests/kernels/test_attention_nvfp4_wgmma_gpu.py 2>&1 | tail -3
