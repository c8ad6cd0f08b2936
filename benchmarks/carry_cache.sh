#!/usr/bin/env bash
# Build, on the CPU, the JIT cache that a device session carries (`carry: [".whl", ".h3carry"]`),
# so that `h200_session.sh` spends no device time compiling the modules it times.
#
#   bash benchmarks/carry_cache.sh [DIR]        DIR defaults to .h3carry (git-ignored)
#
# Builds every production module for sm_90a (`flashinfer_h3 warmup`), the benchmark builds that
# `h200_session.sh record` times (NVFP4 without the P quantisation, without the softmax), and the
# extra benchmark builds named in CARRY_BUILDS, one `op:--only filter` pair per entry separated by
# `;` (e.g. CARRY_BUILDS='fp8:DRAM traffic;nvfp4:DRAM traffic'). The modules' object, lock and
# dependency files are removed afterwards (a carry is limited to 64 MiB); the shared libraries are
# all a session loads. A module's directory name ends in the hash of its sources and flags, so a
# change to any template header makes every module new: rebuild the carry after one.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.h3carry}
mkdir -p "$dest"
export FLASHINFER_H3_CACHE_DIR="$(cd "$dest" && pwd)"
python3 -m flashinfer_h3 warmup --arch sm_90a
python3 benchmarks/bench_wgmma_variants.py --build-only --op nvfp4 --only "P not quantised,no softmax (S"
IFS=';' read -r -a extra <<< "${CARRY_BUILDS:-}"
for entry in "${extra[@]}"; do
    [[ -n $entry ]] || continue
    python3 benchmarks/bench_wgmma_variants.py --build-only --op "${entry%%:*}" --only "${entry#*:}"
done
find "$dest" \( -name '*.o' -o -name '*.lock' -o -name '*.d' \) -delete
echo "carry_cache: $(du -sh "$dest" | cut -f1) in $dest (carry limit 64 MiB with .whl):"
find "$dest" -name '*.so' -printf '  %P\n' | sort
