#!/usr/bin/env bash
# Long contexts on one H100: the serving demo's longctx preset (16 prompts of 32K-64K
# tokens, chunked prefill in 8K chunks, 256-1,024 decode tokens) and the attention kernels
# at 128K and 512K tokens, in parts that each fit one 10-minute call; every call ends with
# the goal tables of what OUT_DIR holds so far.
#   scripts/gpu/long_context.sh OUT_DIR PART...
# Parts:
#   test        first: the chunk kernels of every store against fp32 attention, and the
#               C++ ExpectedTokens and LongSlots suites on CUDA (~3 min with the builds)
#   longctx-1 longctx-2 longctx-3
#               repeat 1-3 of the demo over vkv per-layer and interleaved (FlashInfer's
#               kernels) and FlashInfer paged 16 and 128, the store order rotated by repeat,
#               each store in a process of its own (one slow or failing store keeps the
#               others' results): ~100 s a store on an H100, ~7 min a part.
#   longctx-flex
#               FlexAttention paged (128-token pages) once, alone in its call (~150 s on an H100).
#   kernels     attention_bench.py --only long for Llama-3-8B (decode, and an 8K chunk over a
#               120K / 504K prefix; 512K of K/V is 64 GiB interleaved: --vkv-budget-gib 64)
#   kernels-gqa the same for the Llama-3-70B shape (64 query / 8 KV heads)
#   mapping     one 128K-token prompt in 8K chunks, per configuration (128 MiB large pages
#               announced, 2 MiB pages announced, not announced): step() per chunk against the
#               chunk's forward, the mapping rate (GB/s) with the page size, and whether the
#               prompt's memory was mapped when its first chunk's forward ended (~2 min)
#   goals       only the tables (no GPU needed)
# FlashInfer comes from .whl/ (scripts/gpu/flashinfer_env.sh); its kernels compile at first
# use, ~100 s on a fresh machine, inside the first part that runs them.
set -uo pipefail
cd "$(dirname "$0")/../.."
usage="usage: scripts/gpu/long_context.sh OUT_DIR PART... (test, longctx-{1,2,3}, longctx-flex, kernels, kernels-gqa, mapping, goals)"
mkdir -p "${1:?$usage}"
out="$(cd "$1" && pwd)"
shift
parts="${*:?$usage}"
src="$PWD"
deadline=$((SECONDS + ${VKV_GPU_SECONDS:-580}))  # the serving parts stop starting stores past it
export PYTHONUNBUFFERED=1
status=0

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

stores="vkv-per-layer-fi-128 flashinfer-16 vkv-interleaved-fi-128 flashinfer-128"

serve_longctx() {  # serve_longctx REPEAT STORE...: each store alone, the order rotated by REPEAT
  local repeat="$1"
  shift
  local order=("$@")
  local turn=$(((repeat - 1) % ${#order[@]}))
  for store in "${order[@]:turn}" "${order[@]:0:turn}"; do
    local left=$((deadline - SECONDS))
    if [ $left -lt 120 ]; then
      echo "=== serving_longctx_${repeat}_$store: not run (${left} s left of the call's time)"
      status=1
      continue
    fi
    step "serving_longctx_${repeat}_$store" $((left < 570 ? left : 570)) python3 -m lab.serving --preset longctx \
      --repeats 1 --first-repeat "$repeat" --stores "$store" --no-progress --out "$out/longctx-$repeat-$store"
  done
}

if [ "$parts" != goals ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
  echo "commit $(tree_commit)" | tee "$out/commit.txt"
  install_vkv || exit 1
  # shellcheck source=scripts/gpu/flashinfer_env.sh
  source scripts/gpu/flashinfer_env.sh || echo "FlashInfer is not available: its stores and kernels are skipped"
fi
for part in $parts; do
  case "$part" in
    test)
      step chunk_kernels 300 python3 -m pytest "$src/tests/lab/serving/test_chunked_prefill_gpu.py" \
        "$src/tests/python/test_expect_tokens.py" -q -p no:cacheprovider -rs
      echo "=== C++ suites ($(date +%T))"
      (cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null &&
        cmake --build build-gpu --target vkv_tests 2>&1 | tail -2 &&
        ./build-gpu/tests/cpp/vkv_tests --gtest_filter='*ExpectedTokens*:*LongSlots*') > "$out/cpp_tests.log" 2>&1
      rc=$?
      tail -4 "$out/cpp_tests.log"
      [ $rc -eq 0 ] || status=1 ;;
    longctx-[123])
      # shellcheck disable=SC2086
      serve_longctx "${part:8:1}" $stores ;;
    longctx-flex)
      serve_longctx 1 paged-128 ;;
    kernels)
      step attention_long_llama3_8b 570 python3 -m benchmarks.attention.attention_bench --only long \
        --models llama3-8b --vkv-budget-gib 64 --rounds 3 --out "$out" ;;
    kernels-gqa)
      step attention_long_llama3_70b 570 python3 -m benchmarks.attention.attention_bench --only long \
        --models llama3-70b --vkv-budget-gib 64 --rounds 3 --out "$out" ;;
    mapping)
      step long_prompt_mapping 300 python3 -m benchmarks.long_context.long_prompt_mapping --out "$out" ;;
    goals) ;;
    *)
      echo "unknown part $part; $usage"
      status=1 ;;
  esac
done
echo "=== goals ($(date +%T))"
(cd /tmp && python3 -m benchmarks.long_context.long_context_goals --serving "$out"/longctx-* \
  --kernels "$out"/attention_long_*.json --mapping "$out"/long_prompt_mapping_*.json) | tee "$out/goals.md"
exit $status
