#!/usr/bin/env bash
# vLLM connector replay with tensor parallelism on 2 GPUs (two H100s; ~5 minutes after vkv's
# build, ≤ 8): the block decisions recorded with vLLM 0.33's real scheduler
# (benchmarks/vllm_replay/traces/vllm_trace.json, as scripts/gpu/vllm_replay.sh) replayed by two processes,
# tensor-parallel rank r on cuda:r, each with its shard in its own vkv reservation: the
# connector's worker side for TP (ShardMemory, python/vkv/integrations/vllm/workers.py), every
# rank backing and giving back the blocks the trace says, the ranks agreeing at each step
# through vkv's shared-memory all-reduce. The model is 32 layers, 16 KV heads, 64 query heads,
# head_dim 128 (bf16), so each rank's shard has Llama-3-8B's shape (8 KV heads, 32 query heads:
# one 16-token block = one 2 MiB page), with its weight GEMMs (--dense); attention by
# FlashInfer's paged kernels over the BLNHC views, on the background mapper (the connector's
# default on CUDA). Each rank asserts its outputs bitwise equal to its own torch.zeros pool and
# every block its batch reads backed; at the end the ranks must hold the same blocks backed.
# Then the same with the ranks' steps unaligned (the older measurement), and with
# Llama-3.1-70B's per-GPU block at TP=2 (2.5 MiB, backed page by page).
# Needs .whl/flashinfer-*.tar.xz (scripts/gpu/flashinfer_pack.py; scripts/gpu/flashinfer_env.sh).
#   scripts/gpu/vllm_tp_replay.sh [OUT]   results: OUT/vllm_tp_replay{,_unaligned,_70b}.json (verdicts),
#                                         OUT/vllm_replay_*_tp2{,_unaligned,_70b}_rank{0,1}.json, OUT/*.log, OUT/summary.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:?no OUT given and \$OUT unset}}"
mkdir -p "$out"
src="$PWD"
export PYTHONUNBUFFERED=1 OUT="$out"
status=0

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
if [ "$(wc -l < "$out/gpu.txt")" -lt 2 ]; then
  echo "vllm_tp_replay: needs 2 GPUs, this machine has $(wc -l < "$out/gpu.txt")" | tee "$out/summary.txt"
  exit 1
fi
install_vkv || exit 1
# shellcheck source=scripts/gpu/flashinfer_env.sh
source scripts/gpu/flashinfer_env.sh || exit 1
echo "tree $(tree_commit)" | tee "$out/summary.txt"

trace="$src/benchmarks/vllm_replay/traces/vllm_trace.json"
# FlashInfer JIT-compiles its decode (~13 s) and prefill (~90 s) kernels at first use: once,
# in one process, for a rank's shape (the ranks would otherwise compile them side by side).
step warm 240 env OUT= python3 -m benchmarks.vllm_replay.vllm_replay replay "$trace" --device cuda \
  --attention flashinfer --shape 32,8,128,32 --steps 2
step tp2_replay 240 python3 -m benchmarks.vllm_replay.vllm_tp_replay "$trace" --tp 2 --device cuda \
  --attention flashinfer --shape 32,16,128,64 --dense
# The same unaligned (each rank's steps start when its own last one ended, as the measurement
# of tree 3bc2c0c had them): comparable with that tree's +1.14 / +2.01 ms a step.
step tp2_replay_unaligned 240 python3 -m benchmarks.vllm_replay.vllm_tp_replay "$trace" --tp 2 --device cuda \
  --attention flashinfer --shape 32,16,128,64 --dense --no-barrier --tag unaligned
# Llama-3.1-70B's block a GPU at TP=2 (80 layers, 4 KV heads a rank: 2.5 MiB, straddling 2 MiB
# pages: backed page by page), 16 query heads a rank (FlashInfer's GQA group of 4, as above).
step tp2_replay_70b 240 python3 -m benchmarks.vllm_replay.vllm_tp_replay "$trace" --tp 2 --device cuda \
  --attention flashinfer --shape 80,8,128,32 --dense --tag 70b
grep -hE "^(rank|tp=)" "$out/tp2_replay.log" "$out/tp2_replay_unaligned.log" "$out/tp2_replay_70b.log" |
  tee -a "$out/summary.txt"
exit $status
