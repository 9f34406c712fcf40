#!/usr/bin/env bash
# vLLM's recorded block decisions replayed on one GPU over vkv.BlockBacking and a torch.zeros
# pool, eager and from CUDA graphs, for Llama-3-8B and DeepSeek-V2-Lite's MLA (one H200 or H100;
# ~5-7 minutes with vkv's build and FlashInfer's kernels, at most 9: the replays shrink to one
# round each where the build ran long).
#   llama  benchmarks/vllm_replay/traces/vllm_trace.json (64 requests of 100-154 prompt tokens and 160
#          generated, 166 steps, 155 of them decode steps at batch 64) at Llama-3-8B's shape
#          (32 layers, 8 KV heads, 32 query heads, head_dim 128: a 16-token block = one 2 MiB
#          page), FlashInfer's paged decode/prefill over the BLNHC views, its weight GEMMs
#   mla    benchmarks/vllm_replay/traces/vllm_trace_mla.json at DeepSeek-V2-Lite's MLA cache (27 layers of
#          576, 32-token blocks of 995,328 B straddling 2 MiB pages), FlashInfer's MLA kernel
#          (FA2), its active weight GEMMs
# Each replay runs every launch (eager; graph: decode steps from CUDA graphs as vLLM's default
# FULL_AND_PIECEWISE runs them, the rest eager) VLLM_REPLAY_ROUNDS times (3), rotated, in one
# process; every step's outputs must be bitwise equal between the pools. The worker's memory is
# driven as the connector's: one submit(release, target) per step at the bind, the job kept
# until the forward is queued and then run on vkv's C++ thread (--job-start after-launch, as
# vLLM 0.33's start_load_kv(); VLLM_REPLAY_LLAMA_ARGS="--job-start bind" starts it at the bind,
# "--job-start after-launch,bind" runs both in one process, rotated);
# the first step's target is backed before the clock (--admission ahead).
# FlashInfer's kernels are built (or loaded from the archive's AOT modules) by two processes
# started before vkv's build and running beside it (~13 s decode, ~90 s FA3 prefill, 1-2 min
# MLA, where the archive has none compiled).
#   scripts/gpu/vllm_replay.sh OUT
#     OUT/summary.txt             the goal table per trace and launch (median a step, p90, totals,
#                                 against the goals) and where a step goes (launch, GPU, drain, wait)
#     OUT/vllm_replay_llama.json, OUT/vllm_replay_mla.json   every run's summary (commit these)
#     OUT/logs.tar.gz             every log, the raw per-step seconds (*_steps.json), gpu.txt
# VLLM_REPLAY_PARTS: "llama mla" by default; "memcheck" runs the 27-step trace under
# compute-sanitizer memcheck instead (torch's attention eager, then FlashInfer's FA2 eager and
# graphed, --control; ~5 minutes). VLLM_REPLAY_LLAMA_ARGS, VLLM_REPLAY_MLA_ARGS: arguments added
# to that trace's warm-up and replay (the last of a repeated option wins), e.g. "--steps 40". Needs .whl/flashinfer-*.tar.xz with MLA's sources
# (scripts/gpu/flashinfer_pack.py makes it; scripts/gpu/flashinfer_env.sh unpacks it).
set -uo pipefail
cd "$(dirname "$0")/../.."
result="${1:-${OUT:?no OUT given and \$OUT unset}}"
mkdir -p "$result" && result="$(cd "$result" && pwd)"  # the steps run from /tmp
out="$result/logs"  # step()'s logs (common.sh), packed into logs.tar.gz at the end
mkdir -p "$out"
src="$PWD"
export PYTHONUNBUFFERED=1
status=0
deadline=$((SECONDS + ${VLLM_REPLAY_DEADLINE:-540}))  # one call's 10 minutes, less packing the results
rounds="${VLLM_REPLAY_ROUNDS:-3}"
parts=" ${VLLM_REPLAY_PARTS:-llama mla} "
summary="$result/summary.txt"

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

finish() {  # the logs in one archive (a call brings few files back), then the exit status
  tar -czf "$result/logs.tar.gz" -C "$result" logs && rm -rf "$out"
  exit "$status"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
echo "vLLM replay on $(head -1 "$out/gpu.txt"), tree $(tree_commit), $(date -u +%FT%TZ)" | tee "$summary"
# shellcheck source=scripts/gpu/flashinfer_env.sh
if ! source scripts/gpu/flashinfer_env.sh > "$out/flashinfer_env.log" 2>&1; then
  cat "$out/flashinfer_env.log"
  echo "vllm_replay: FlashInfer is not importable (flashinfer_env.log): nothing replayed" | tee -a "$summary"
  status=1
  finish
fi
mla_sources=$(python3 -c 'from flashinfer.jit import env; print(int((env.FLASHINFER_CSRC_DIR / "batch_mla_run.cu").is_file()))')
if [[ "$parts" == *" mla "* && "$mla_sources" != 1 ]]; then
  echo "vllm_replay: the FlashInfer archive has no MLA sources (pack one with scripts/gpu/flashinfer_pack.py): no mla" |
    tee -a "$summary"
  parts="${parts/ mla / }"
  status=1
fi
aot=$(ls -d "$flashinfer_site"/flashinfer/data/aot/*/ 2>/dev/null | wc -l)
echo "flashinfer: $(grep -o 'flashinfer [^ ]*' "$out/flashinfer_env.log" | head -1), $aot modules compiled ahead in the archive" |
  tee -a "$summary"

read -ra llama_extra <<< "${VLLM_REPLAY_LLAMA_ARGS:-}"
read -ra mla_extra <<< "${VLLM_REPLAY_MLA_ARGS:-}"
llama=(--device cuda --attention flashinfer --shape 32,8,128,32 "${llama_extra[@]}")
mla=(--device cuda --attention flashinfer --backend fa2 "${mla_extra[@]}")
warm() {  # NAME COMMAND...: builds or loads FlashInfer's kernels in the background (no vkv needed)
  local name="$1"
  shift
  (cd /tmp && timeout 420 "$@" > "$out/warm_$name.log" 2>&1; echo "exit $? after $((SECONDS - warm_start)) s" >> "$out/warm_$name.log") &
}
warm_start=$SECONDS
pids=()
if [[ "$parts" == *" llama "* || "$parts" == *" memcheck "* ]]; then
  warm llama python3 -m benchmarks.vllm_replay.vllm_replay warm "${llama[@]}"
  pids+=($!)
  if [[ "$parts" == *" memcheck "* ]]; then
    warm llama_fa2 python3 -m benchmarks.vllm_replay.vllm_replay warm "${llama[@]}" --prefill-backend fa2
    pids+=($!)
  fi
fi
if [[ "$parts" == *" mla "* ]]; then
  warm mla python3 -m benchmarks.vllm_replay.vllm_mla_replay warm "${mla[@]}"
  pids+=($!)
fi
install_vkv > "$out/build.log" 2>&1 || { cat "$out/build.log"; echo "vllm_replay: vkv's build failed (build.log)" |
  tee -a "$summary"; status=1; finish; }
echo "vkv built at $((SECONDS - warm_start)) s" | tee -a "$out/times.txt"
for pid in "${pids[@]}"; do wait "$pid"; done
for log in "$out"/warm_*.log; do echo "$(basename "$log" .log): $(tail -1 "$log")"; done | tee -a "$out/times.txt"
if grep -q "^exit [^0]" "$out"/warm_*.log; then
  echo "vllm_replay: a FlashInfer warm-up failed (logs.tar.gz: warm_*.log); its replay will build what it needs" |
    tee -a "$summary"
fi

replay() {  # NAME SCRIPT TRACE ARGS...: one trace, every launch, the rounds that fit before the deadline
  local name="$1" script="$2" trace="$3" left=$((deadline - SECONDS)) n="$rounds"
  shift 3
  if [ "$left" -lt 60 ]; then
    echo "$name: not run, ${left} s left before the deadline" | tee -a "$summary"
    status=1
    return
  fi
  # Eager and graphed runs take ~20 s a round for each trace, the setup ~30 s: one round where
  # less than 2.5 minutes are left for this trace.
  [ "$left" -lt 150 ] && n=1
  [[ "$parts" == *" mla "* && "$name" == llama && "$left" -lt 300 ]] && n=1
  step "$name" "$((left - 10))" env OUT="$out" python3 -m "benchmarks.vllm_replay.${script%.py}" replay "$src/benchmarks/vllm_replay/traces/$trace" \
    --dense --launch eager,graph --rounds "$n" --name "$name" "$@"
  if [ -f "$out/vllm_replay_$name.json" ]; then
    mv "$out/vllm_replay_$name.json" "$result/"
  else
    echo "$name: no result (logs.tar.gz: $name.log): $(grep -m1 -E "Error|error" "$out/$name.log")" | tee -a "$summary"
  fi
}

if [[ "$parts" == *" llama "* ]]; then
  replay llama vllm_replay.py vllm_trace.json "${llama[@]}"
fi
if [[ "$parts" == *" mla "* ]]; then
  replay mla vllm_mla_replay.py vllm_trace_mla.json "${mla[@]}"
fi
results=("$result"/vllm_replay_*.json)
if [ -f "${results[0]}" ]; then
  echo | tee -a "$summary"
  python3 -m benchmarks.vllm_replay.vllm_replay table "${results[@]}" | tee -a "$summary"
  grep -h "graph capture failed" "$out"/*.log | tee -a "$summary"
fi

sanitizer="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)"
if [[ "$parts" != *" memcheck "* ]]; then
  :
elif [ -n "$sanitizer" ]; then
  # The 27-step trace (its last two steps give 157 blocks back), the whole of it, under
  # memcheck: torch's attention (eager only: a graph needs FlashInfer's), then FlashInfer's with
  # its FA2 prefill (compiled outside the sanitizer by the warm-up above), eager and graphed.
  # --keep-going: a step whose outputs differ under the sanitizer is counted, not fatal;
  # --control runs the fixed pool twice a step: a kernel that differs from itself there is
  # nondeterministic under the sanitizer, not fed wrong bytes by vkv.
  memcheck=("$sanitizer" --tool memcheck --target-processes application-only --error-exitcode 3)
  small=(python3 -m benchmarks.vllm_replay.vllm_replay replay "$src/benchmarks/vllm_replay/traces/vllm_trace_memcheck.json"
         --keep-going --control)
  step memcheck_torch 240 env OUT="$out" "${memcheck[@]}" "${small[@]}" --device cuda --attention torch \
    --shape 4,64,128,64 --name memcheck_torch
  step memcheck_fa2 240 env OUT="$out" "${memcheck[@]}" "${small[@]}" "${llama[@]}" --prefill-backend fa2 \
    --launch eager,graph --name memcheck_fa2
  for name in memcheck_torch memcheck_fa2; do
    errors=$(grep -o "ERROR SUMMARY: [0-9]* error" "$out/$name.log" | tail -1)
    echo "$name: memcheck ${errors:-reported no summary}; $(grep -E "^memcheck_[a-z0-9]+ [a-z]+ run" "$out/$name.log" | tr '\n' ';')" |
      tee -a "$summary"
  done
else
  echo "memcheck: no compute-sanitizer on this machine" | tee -a "$summary"
fi

compiled=$(find "$FLASHINFER_WORKSPACE_BASE" -name "*.so" 2>/dev/null | wc -l)
echo "flashinfer: $compiled modules compiled on this machine; times: $(tr '\n' ';' < "$out/times.txt")" | tee -a "$summary"
echo "total $((SECONDS)) s" | tee -a "$summary"
finish
