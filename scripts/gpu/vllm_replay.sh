#!/usr/bin/env bash
# vLLM connector replay on CUDA (~4 minutes after vkv's build on a fresh H100, ≤ 6):
# the block decisions recorded on a CPU with vLLM 0.33's real scheduler
# (benchmarks/vllm_replay/traces/vllm_trace.json: 64 requests of 100-154 prompt tokens and 160 generated,
# 164 steps, 155 of them decode steps at batch >= 60; vLLM's scheduler makes the same 164 steps on its fixed pool) replayed at Llama-3-8B's shape (32 layers,
# 8 KV heads, 32 query heads, head_dim 128: one 16-token block = one 2 MiB page) over vkv
# memory and over a torch.zeros pool (as vLLM zeroes its own), attention by FlashInfer's paged
# decode/prefill reading the block tables straight out of the BLNHC views, with Llama-3-8B's
# weight GEMMs (--dense) so that a step costs what a real one does. Each run asserts the
# outputs bitwise equal and writes map/unmap cost per block and the per-step overhead against
# the fixed pool (all steps, and decode steps at batch 60-64: total, per-step median and p90):
#   fi_bg_dense     vLLM's order: bind_connector_metadata() before the forward is queued takes the
#                   step's job, start_load_kv() after it starts the job on the worker's background
#                   mapper thread (the connector's default on CUDA); vkv's step ends when its
#                   forward and that job are both done
#   fi_bg_at_bind_dense  the same, the job started at the bind (the connector until 3d074f7)
#   gpu_tests       the background mapper's GPU tests (tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py)
#   memcheck        the 27-step trace benchmarks/vllm_replay/traces/vllm_trace_memcheck.json (16 requests, the
#                   last two steps give 157 blocks back) with the background mapping under
#                   compute-sanitizer memcheck: torch's attention, then FlashInfer's with its FA2
#                   prefill and with its FA3 one (~4 minutes; --control: FA3's prefill differs
#                   from itself under the sanitizer, vllm_replay_memcheck_166f582_h100.log)
# VLLM_REPLAY_ALL=1 adds the attention-only run and the synchronous mappings, before the forward
# and after it is queued (~1 minute more); VLLM_REPLAY_PARTS ("tests replay memcheck" by default) runs some parts only (one per
# run where a run's time is limited). Needs .whl/flashinfer-*.tar.xz (scripts/gpu/flashinfer_pack.py
# makes it; scripts/gpu/flashinfer_env.sh unpacks it).
#   scripts/gpu/vllm_replay.sh [OUT]      results: OUT/vllm_replay_*.json, OUT/*.log, OUT/summary.txt
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

replay=(-m benchmarks.vllm_replay.vllm_replay replay "$src/benchmarks/vllm_replay/traces/vllm_trace.json" --device cuda)
llama=(--attention flashinfer --shape 32,8,128,32)
summary() {  # one result JSON in three lines
  python3 - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
d, s = r["decode_batch_ge_60"], r["step_ms"]
def spread(x):
    if not x:
        return "no spread"
    return (f"per step median {x['ms']['median']:+.3f} ms ({100 * x['relative']['median']:+.2f}%) "
            f"p90 {x['ms']['p90']:+.3f} ms ({100 * x['relative']['p90']:+.2f}%)"
            + (f" trimmed mean {x['ms']['trimmed_mean']:+.3f} ms ({100 * x['relative']['trimmed_mean']:+.2f}%)"
               if "trimmed_mean" in x["ms"] else ""))
print(f"{sys.argv[1].rsplit('/', 1)[-1]}: mapping={r.get('mapping', r['map'])} bitwise_equal={r['bitwise_equal']} "
      f"map {r['map_us_per_block']:.1f} us/block unmap {r['unmap_us_per_block']:.1f} us/block")
print(f"  all {r['steps']} steps: vkv {s['vkv']:.3f} ms fixed {s['fixed']:.3f} ms job {s['map']:.3f} ms "
      f"bind {s.get('bind', 0):.3f} ms wait {s.get('wait', 0):.3f} ms; overhead {100 * r['overhead_vs_fixed']:.2f}%, "
      + spread(r.get("per_step_overhead")))
if d["overhead_vs_fixed"] is not None:
    print(f"  decode batch>=60 ({d['steps']} steps): vkv {d['step_ms']['vkv']:.3f} ms fixed {d['step_ms']['fixed']:.3f} ms "
          f"job {d['step_ms']['map']:.3f} ms wait {d['step_ms'].get('wait', 0):.3f} ms; overhead "
          f"{100 * d['overhead_vs_fixed']:.2f}%, " + spread(d.get("per_step_overhead")))
EOF
}

parts=" ${VLLM_REPLAY_PARTS:-tests replay memcheck} "
: > "$out/summary.txt"
if [[ "$parts" == *" tests "* ]]; then
  step gpu_tests 120 python3 -m pytest "$src/tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py" -q -p no:cacheprovider -rs \
    -k "background or vllm_buffer"
  echo "gpu_tests: $(tail -1 "$out/gpu_tests.log")" | tee -a "$out/summary.txt"
fi
if [[ "$parts" == *" replay "* ]]; then
  # FlashInfer JIT-compiles its decode (~13 s) and prefill (~90 s) kernels in the first run's
  # warm-up, outside the timings; the later runs find them in FLASHINFER_WORKSPACE_BASE.
  step fi_bg_dense 240 python3 "${replay[@]}" "${llama[@]}" --dense --mapping background
  step fi_bg_at_bind_dense 90 python3 "${replay[@]}" "${llama[@]}" --dense --mapping background_at_bind
  if [ "${VLLM_REPLAY_ALL:-0}" = 1 ]; then
    step fi_ahead_dense 90 python3 "${replay[@]}" "${llama[@]}" --dense --mapping ahead
    step fi_before_dense 90 python3 "${replay[@]}" "${llama[@]}" --dense --mapping before
    step fi_bg 60 python3 "${replay[@]}" "${llama[@]}" --mapping background
  fi
  echo "=== summary"
  for f in "$out"/vllm_replay_*.json; do [ -f "$f" ] && summary "$f"; done | tee -a "$out/summary.txt"
fi

sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
if [[ "$parts" != *" memcheck "* ]]; then
  :
elif [ -n "$sanitizer" ]; then
  # The 27-step trace (its last two steps give 157 blocks back), the whole of it. torch's
  # attention first (no JIT: 4 layers x 64 KV heads keep a 16-token block one 2 MiB page),
  # then FlashInfer's, compiled outside the sanitizer by a plain run first (application-only:
  # its compiler subprocesses stay outside anyway). --keep-going: a step whose outputs differ
  # under the sanitizer is counted, not fatal; --control runs the fixed pool twice a step: a
  # kernel that differs from itself there is nondeterministic under the sanitizer, not fed
  # wrong bytes by vkv (FlashInfer's FA3 prefill at step 1: vllm_replay_memcheck_166f582_h100.log).
  small=(-m benchmarks.vllm_replay.vllm_replay replay "$src/benchmarks/vllm_replay/traces/vllm_trace_memcheck.json" --device cuda)
  memcheck=("$sanitizer" --tool memcheck --target-processes application-only --error-exitcode 3)
  digest() {  # NAME: the sanitizer's verdict and the run's comparisons, one line
    python3 - "$1" "$out/$1.log" "$out/$1"/*.json <<'EOF'
import json, re, sys
name, log, result = sys.argv[1], open(sys.argv[2]).read(), json.load(open(sys.argv[3]))
errors = re.findall(r"ERROR SUMMARY: (\d+) error", log)
print(f"{name}: memcheck errors {errors[-1] if errors else 'none reported'}; {result['steps']} steps, "
      f"{result['unmap_calls']} unmaps; vkv == fixed: {result['bitwise_equal']} {result['mismatched_steps']}; "
      f"fixed == fixed: {not result['control_mismatched_steps']} {result['control_mismatched_steps']}")
EOF
  }
  mkdir -p "$out/memcheck_torch"
  step memcheck_torch 300 env OUT="$out/memcheck_torch" "${memcheck[@]}" \
    python3 "${small[@]}" --attention torch --shape 4,64,128,64 --mapping background --keep-going --control
  digest memcheck_torch | tee -a "$out/summary.txt"
  for backend in fa2 auto; do  # auto: FA3 on Hopper
    mkdir -p "$out/memcheck_$backend"
    step memcheck_warm_$backend 240 env OUT= python3 "${small[@]}" "${llama[@]}" --prefill-backend $backend --steps 2
    step memcheck_$backend 300 env OUT="$out/memcheck_$backend" "${memcheck[@]}" \
      python3 "${small[@]}" "${llama[@]}" --prefill-backend $backend --mapping background --keep-going --control
    digest memcheck_$backend | tee -a "$out/summary.txt"
  done
else
  echo "memcheck: no compute-sanitizer on this machine" | tee -a "$out/summary.txt"
fi
exit $status
