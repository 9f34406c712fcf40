#!/usr/bin/env bash
# vkv inside SGLang on CUDA, without SGLang (~2 minutes after vkv's build, FlashInfer's JIT
# included; <= 3): the placement tests of SGLang's pool buffers carved from vkv memory
# (tests/python/integrations/sglang_engine/test_sglang_gpu_placement.py), then the KV
# decisions recorded on a CPU with SGLang 0.5.23's own engine and vkv's allocator
# (benchmarks/sglang_replay/traces/sglang_trace.json) replayed at Llama-3-8B's shape (32 layers, 8 KV
# heads, 32 query heads, head_dim 128, 16-token pages) over vkv memory and over torch.zeros
# buffers of SGLang's shapes, attention by FlashInfer's paged decode/prefill (SGLang's
# FlashInfer backend) with Llama-3-8B's weight GEMMs: outputs bitwise equal, and vkv's
# per-step cost against the fixed pool (all steps; decode steps at batch >= 60). One line:
#   sglang_replay: tests <pytest's last line>; replay bitwise_equal=.. decode batch>=60 median +..% ...
# Needs .whl/flashinfer-*.tar.xz (scripts/gpu/flashinfer_env.sh).
#   scripts/gpu/sglang_replay.sh [OUT]      results: OUT/sglang_replay_*.json, OUT/*.log, OUT/summary.txt
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
install_vkv || exit 1
# shellcheck source=scripts/gpu/flashinfer_env.sh
source scripts/gpu/flashinfer_env.sh || exit 1

step gpu_tests 60 python3 -m pytest "$src/tests/python/integrations/sglang_engine/test_sglang_gpu_placement.py" \
  -q -p no:cacheprovider -rs
step replay 150 python3 -m benchmarks.sglang_replay.sglang_replay replay "$src/benchmarks/sglang_replay/traces/sglang_trace.json" \
  --device cuda --attention flashinfer --shape 32,8,128,32 --dense
python3 - "$out" "$(tail -1 "$out/gpu_tests.log")" "$(tree_commit)" <<'PY' | tee "$out/summary.txt"
import glob, json, sys
out, tests, commit = sys.argv[1:4]
parts = [f"sglang_replay ({commit}): tests {tests}"]
for path in glob.glob(f"{out}/sglang_replay_*.json"):
    r = json.load(open(path))
    d, a = r["decode_batch_ge_60"], r["per_step_overhead"]
    rel = lambda s: "n/a" if not s else f"{100 * s['relative']['median']:+.2f}% ({s['ms']['median']:+.3f} ms)"
    parts.append(f"replay {r['gpu']} bitwise_equal={r['bitwise_equal']} steps={r['steps']} "
                 f"vkv {r['step_ms']['vkv']:.3f} ms fixed {r['step_ms']['fixed']:.3f} ms backing {r['step_ms']['backing']:.3f} ms; "
                 f"median per step {rel(a)}; decode batch>=60 ({d['steps']} steps) median {rel(d['per_step_overhead'])}")
print("; ".join(parts) if len(parts) > 1 else parts[0] + "; replay: no result (see replay.log)")
PY
exit $status
