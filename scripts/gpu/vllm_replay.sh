#!/usr/bin/env bash
# vLLM connector replay on CUDA (issue 31; ~5 minutes after vkv's build on a fresh H100, ≤ 9):
# the block decisions recorded on a CPU with vLLM 0.33's real scheduler
# (benchmarks/results/vllm_trace.json: 64 requests, 42 steps, decode batch up to 64) replayed
# at Llama-3-8B's shape (32 layers, 8 KV heads, 32 query heads, head_dim 128: one 16-token
# block = one 2 MiB page) over vkv memory and over a torch.zeros pool (as vLLM zeroes its own), attention by
# FlashInfer's paged decode/prefill reading the block tables straight out of the BLNHC views.
# Each run asserts the outputs bitwise equal and writes map/unmap cost per block and the
# per-step overhead against the fixed pool (all steps, and decode steps at batch 60-64):
#   fi            mapping before the forward (what the connector's bind_connector_metadata does)
#   fi_ahead      mapping while the forward runs (--map-ahead)
#   fi_dense*     the same with Llama-3-8B's weight GEMMs, so a step costs what a real one does
#   memcheck      the first 11 steps (prefills, then a decode step at batch 63 that unmaps 107
#                 blocks) under compute-sanitizer memcheck, when it is installed
# VLLM_REPLAY_TORCH=1 adds the first replay's SDPA path (~1 minute more); VLLM_REPLAY_PARTS
# ("replay memcheck" by default) runs one part per call where the machine's limit is near.
# Needs .whl/flashinfer-*.tar.xz (carry .whl): scripts/gpu/flashinfer_env.sh.
#   scripts/gpu/vllm_replay.sh [OUT]      results: OUT/vllm_replay_*.json, OUT/*.log
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:?no OUT given and \$OUT unset}}"
mkdir -p "$out"
src="$PWD"
export PYTHONUNBUFFERED=1 OUT="$out"  # where vllm_replay.py writes its JSON
status=0

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
install_vkv || exit 1
# shellcheck source=scripts/gpu/flashinfer_env.sh
source scripts/gpu/flashinfer_env.sh || exit 1

replay=("$src/benchmarks/vllm_replay.py" replay "$src/benchmarks/results/vllm_trace.json" --device cuda)
llama=(--attention flashinfer --shape 32,8,128,32)
summary() {  # summary JSON: one line per result
  python3 - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
d = r["decode_batch_ge_60"]
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: bitwise_equal={r['bitwise_equal']} map {r['map_us_per_block']:.1f} us/block "
      f"unmap {r['unmap_us_per_block']:.1f} us/block; all {r['steps']} steps: vkv {r['step_ms']['vkv']:.3f} ms "
      f"fixed {r['step_ms']['fixed']:.3f} ms map {r['step_ms']['map']:.3f} ms overhead {100 * r['overhead_vs_fixed']:.2f}%; "
      f"decode batch>=60 ({d['steps']} steps): vkv {d['step_ms']['vkv']:.3f} ms fixed {d['step_ms']['fixed']:.3f} ms "
      + (f"overhead {100 * d['overhead_vs_fixed']:.2f}%" if d["overhead_vs_fixed"] is not None else "none"))
EOF
}

parts=" ${VLLM_REPLAY_PARTS:-replay memcheck} "
if [[ "$parts" == *" replay "* ]]; then
  # FlashInfer JIT-compiles its decode (~13 s) and prefill (~90 s) kernels in the first run's
  # warm-up, outside the timings; the later runs find them in FLASHINFER_WORKSPACE_BASE.
  step fi 240 python3 "${replay[@]}" "${llama[@]}"
  step fi_ahead 60 python3 "${replay[@]}" "${llama[@]}" --map-ahead
  step fi_dense 60 python3 "${replay[@]}" "${llama[@]}" --dense
  step fi_dense_ahead 60 python3 "${replay[@]}" "${llama[@]}" --dense --map-ahead
  if [ "${VLLM_REPLAY_TORCH:-0}" = 1 ]; then
    step torch 200 python3 "${replay[@]}" --shape 32,8,128
  fi
  echo "=== summary"
  for f in "$out"/vllm_replay_*.json; do [ -f "$f" ] && summary "$f"; done | tee "$out/summary.txt"
fi

sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
if [[ "$parts" != *" memcheck "* ]]; then
  :
elif [ -n "$sanitizer" ]; then
  # application-only: FlashInfer's compiler subprocesses (none, kernels cached) stay outside.
  step memcheck 240 env OUT= "$sanitizer" --tool memcheck --target-processes application-only --error-exitcode 3 \
    python3 "${replay[@]}" "${llama[@]}" --steps 11
  grep -E "ERROR SUMMARY|bitwise_equal" "$out/memcheck.log" | tee -a "$out/summary.txt"
else
  echo "memcheck: no compute-sanitizer on this machine" | tee -a "$out/summary.txt"
fi
exit $status
