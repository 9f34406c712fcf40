#!/usr/bin/env bash
# On a machine with 2 GPUs (two H100s), within ~6 minutes including the build: what
# TensorParallelCache.step() costs over two ranks, one GPU each, agreeing through shared
# memory (goal p50 <= 50 us, p99 <= 150 us, against a bare KVCache.step()),
# with a 1 ms "forward" between calls and back to back; then the 2-rank serving demo
# against 1 rank (its throughput ratio must stay ~1.29x). Results and logs in OUT_DIR.
#   scripts/gpu/tp_agreement.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/tp_agreement.sh OUT_DIR}"
mkdir -p "$out/logs"
deadline=$((SECONDS + ${VKV_GPU_SECONDS:-340}))
left() { local l=$((deadline - SECONDS)); l=$((l < $1 ? l : $1)); echo $((l > 1 ? l : 1)); }
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) install_vkv || exit 1  # once per machine and tree
echo "built at ${SECONDS}s"
for gap in 1000 0; do
  (cd /tmp && PYTHONUNBUFFERED=1 timeout "$(left 120)" python3 -m benchmarks.tensor_parallel.tp_agreement --device cuda --gap-us "$gap" --out "$out") \
    > "$out/logs/tp_agreement_gap$gap.log" 2>&1 || { echo "tp_agreement --gap-us $gap: exit $?"; status=1; }
  grep -E "^(KVCache|TensorParallel|all-reduce|_prepare)" "$out/logs/tp_agreement_gap$gap.log" | sed "s/^/gap $gap us: /"
done
(cd /tmp && timeout "$(left 150)" torchrun --nproc-per-node 2 -m lab.serving.tp --device cuda --requests 48 --out "$out") \
  > "$out/logs/demo_tp.log" 2>&1 || { echo "demo tp: exit $?"; status=1; }
grep -iE "throughput|tok/s|x1|ranks agree" "$out/logs/demo_tp.log" | tail -6
echo "status $status, ${SECONDS}s"
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"  # one file back
exit $status
