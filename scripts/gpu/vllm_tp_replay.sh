#!/usr/bin/env bash
# vLLM's recorded block decisions replayed with tensor parallelism on 2 GPUs (two H100s or
# H200s; ~5 minutes after vkv's build, at most 9): benchmarks/vllm_replay/traces/vllm_trace.json (as
# scripts/gpu/vllm_replay.sh) replayed by two processes, tensor-parallel rank r on cuda:r, each
# with its shard in a vkv.BlockBacking of its own, the ranks agreeing on every job that changes
# backing (BlockBacking(agreement=...): one all-reduce round through shared memory); rank 0's
# block states are the scheduler's. The model is 32 layers, 16 KV heads, 64 query heads,
# head_dim 128 (bf16), so each rank's shard has Llama-3-8B's shape (one 16-token block = one
# 2 MiB page), with its weight GEMMs; attention by FlashInfer's paged kernels over the BLNHC
# views; eager and from CUDA graphs, 2 rounds each. Each rank asserts its outputs bitwise equal
# to its own torch.zeros pool and every block its batch reads backed; at the end the ranks must
# hold the same blocks backed. Then the same with Llama-3.1-70B's per-GPU block at TP=2
# (80 layers, 4 KV heads a rank: 2.5 MiB, straddling 2 MiB pages), eager only.
# Needs .whl/flashinfer-*.tar.xz (scripts/gpu/flashinfer_pack.py; scripts/gpu/flashinfer_env.sh).
#   scripts/gpu/vllm_tp_replay.sh OUT   results: OUT/summary.txt (per rank and launch: the goal
#                                       table; the verdicts), OUT/vllm_tp_replay{,_70b}.json,
#                                       OUT/logs.tar.gz (logs, every rank's report)
set -uo pipefail
cd "$(dirname "$0")/../.."
result="${1:-${OUT:?no OUT given and \$OUT unset}}"
mkdir -p "$result" && result="$(cd "$result" && pwd)"
out="$result/logs"
mkdir -p "$out"
src="$PWD"
export PYTHONUNBUFFERED=1
status=0
summary="$result/summary.txt"

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [ "$(wc -l < "$out/gpu.txt")" -lt 2 ]; then
  echo "vllm_tp_replay: needs 2 GPUs, this machine has $(wc -l < "$out/gpu.txt")" | tee "$summary"
  exit 1
fi
echo "vLLM TP=2 replay on $(head -1 "$out/gpu.txt") x2, tree $(tree_commit), $(date -u +%FT%TZ)" | tee "$summary"
# shellcheck source=scripts/gpu/flashinfer_env.sh
source scripts/gpu/flashinfer_env.sh || exit 1
trace="$src/benchmarks/vllm_replay/traces/vllm_trace.json"
# FlashInfer's kernels for a rank's shape, once, beside vkv's build (the ranks would otherwise
# build them side by side).
(cd /tmp && timeout 420 python3 -m benchmarks.vllm_replay.vllm_replay warm --device cuda --attention flashinfer \
  --shape 32,8,128,32 > "$out/warm.log" 2>&1) &
warm_pid=$!
install_vkv > "$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
wait "$warm_pid"
step tp2_replay 240 env OUT="$out" python3 -m benchmarks.vllm_replay.vllm_tp_replay "$trace" --tp 2 --device cuda \
  --attention flashinfer --shape 32,16,128,64 --dense --launch eager,graph --rounds 2
step tp2_replay_70b 180 env OUT="$out" python3 -m benchmarks.vllm_replay.vllm_tp_replay "$trace" --tp 2 --device cuda \
  --attention flashinfer --shape 80,8,128,32 --dense --tag 70b
grep -hE "^(rank [0-9]+:|tp=)" "$out/tp2_replay.log" "$out/tp2_replay_70b.log" | tee -a "$summary"
reports=("$out"/vllm_replay_tp2*_rank[0-9].json)  # not the per-step *_steps.json
[ -f "${reports[0]}" ] && python3 -m benchmarks.vllm_replay.vllm_replay table "${reports[@]}" | tee -a "$summary"
mv "$out"/vllm_tp_replay*.json "$result/" 2>/dev/null
tar -czf "$result/logs.tar.gz" -C "$result" logs && rm -rf "$out"
exit $status
