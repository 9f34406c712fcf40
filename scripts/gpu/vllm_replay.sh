#!/usr/bin/env bash
# vLLM connector replay on CUDA (≤ 9 minutes): the block decisions recorded on a CPU with
# vLLM 0.33's real scheduler (benchmarks/results/vllm_trace.json, 64 requests, decode batch
# up to 64) replayed on vkv memory (BLNHC views of the reservation, Llama-3-8B shape: one
# 16-token block = one 2 MiB page) and on a torch.empty pool: attention outputs bitwise
# equal, map cost per block, per-step overhead; then under compute-sanitizer memcheck
# (8 layers x 32 heads: still a 2 MiB block) when it is installed. Results: $OUT/vllm_replay.json, $OUT/*.log.
set -uo pipefail
export PYTHONUNBUFFERED=1
out="${OUT:?}"
src="$(pwd)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | grep -v WARNING | tail -3
status=0
(cd /tmp && timeout 300 python3 "$src/benchmarks/vllm_replay.py" replay "$src/benchmarks/results/vllm_trace.json" \
  --device cuda --shape 32,8,128) 2>&1 | tee "$out/replay.log" | tail -30 || status=1
if command -v compute-sanitizer >/dev/null; then
  (cd /tmp && OUT= timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 python3 \
    "$src/benchmarks/vllm_replay.py" replay "$src/benchmarks/results/vllm_trace.json" --device cuda --shape 8,32,128) \
    > "$out/memcheck.log" 2>&1
  echo "memcheck exit $?"; tail -5 "$out/memcheck.log"
fi
exit $status
