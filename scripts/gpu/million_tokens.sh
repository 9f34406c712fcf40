#!/usr/bin/env bash
# On a machine with 2 GPUs (two H100s), in ~1.5 minutes with the build (84 s measured): one request
# of a million tokens of Llama-3-8B's KV (128 GiB) over two tensor-parallel ranks of
# vkv.distributed, 4 KV heads and 64 GiB a rank beside the rank's half of the random bf16
# weights: the fill in 8K-token chunks through step() (the mapping rate, pages and bytes),
# then 128 decoded tokens (tok/s, step() per token, peak memory per GPU) and the decode
# kernel against fp32 attention over the whole context (benchmarks/million_tokens/million_tokens.py); a run
# of 128K tokens first, on the same path.
# Results and logs in OUT_DIR, packed as OUT_DIR.tar.gz.
#   scripts/gpu/million_tokens.sh OUT_DIR [million_tokens.py arguments...]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/million_tokens.sh OUT_DIR [million_tokens.py arguments...]}"
shift
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"
deadline=$((SECONDS + ${VKV_GPU_SECONDS:-570}))  # inside a 600 s call
left() { local l=$((deadline - SECONDS)); l=$((l < $1 ? l : $1)); echo $((l > 1 ? l : 1)); }
status=0
src="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
echo "commit $(tree_commit)" | tee "$out/commit.txt"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) install_vkv || exit 1  # once per machine and tree
echo "built at ${SECONDS}s"
# shellcheck source=scripts/gpu/flashinfer_env.sh
source scripts/gpu/flashinfer_env.sh || echo "FlashInfer is not available: decode by PyTorch's FlashAttention-2 varlen"
run() {  # run LOG LIMIT_S ARGUMENTS...
  local log="$out/logs/$1" limit="$2"
  shift 2
  (cd /tmp && PYTHONUNBUFFERED=1 timeout "$(left "$limit")" python3 -m benchmarks.million_tokens.million_tokens --device cuda \
    --ranks 2 --out "$out" "$@") > "$log" 2>&1
  local rc=$?
  grep -E "^(llama|rank|\[)|Error|error|^Thread|^  File" "$log" | tail -30
  return $rc
}
# First the same path at 128K tokens (about a minute): it loads the kernels, and a stall
# shows up here with every rank's stacks (the ranks dump them after 90 s in one phase).
echo "=== 128K tokens first ($(date +%T))"
mkdir -p "$out/small"
run million_tokens_128k.log 120 --tokens 131072 --decode-tokens 16 --out "$out/small" ||
  echo "million_tokens at 128K: exit non-zero (log: logs/million_tokens_128k.log)"
echo "=== 1M tokens ($(date +%T))"
if ! run million_tokens.log 420 "$@"; then
  echo "million_tokens: exit non-zero (log: logs/million_tokens.log)"
  status=1
  # Where the whole model did not fit or failed: each layer's attention and output projection only.
  if ! ls "$out"/million_tokens_*.json > /dev/null 2>&1 && [ $((deadline - SECONDS)) -gt 150 ]; then
    echo "=== again with --decode attention ($(date +%T))"
    run million_tokens_attention.log 420 --decode attention "$@" || echo "million_tokens --decode attention: exit non-zero"
  fi
fi
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader > "$out/gpu_memory_after.txt" 2>&1
echo "status $status, ${SECONDS}s"
tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
exit $status
