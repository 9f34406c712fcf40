#!/usr/bin/env bash
# On the GPU host: several engines on one GPU, vkv's shared budget against kvcached 0.1.6
# (python -m lab.multi_engine, docs/multi_engine.md), the goal table at the end.
#   [VKV_GIT_COMMIT=<sha>] scripts/gpu/multi_engine_vs_kvcached.sh OUT_DIR [PRESET...] [-- demo arguments...]
#
# Without PRESET: the reduced comparison, one call of at most 8 minutes with the builds
# (VKV_DEADLINE_S, default 480 s from the start, a hard stop; fresh machine: vkv's build
# ~2-4 min, kvcached's ~30 s; expected wall time 7.5-8 min, the runs filling what the builds
# leave):
#   1. kvcached3 at --scale 0.5 (its ramps and staggers halved: 76 requests per engine),
#      phases shared (vkv) and kvcached, 3 repeats in rotated order. The first repeat also
#      runs kvcached's settings reserve0 (no pages mapped ahead or kept: an idle engine holds
#      its null block's page only) and limit50 (each instance limited to half of the KV
#      memory, as kvctl limit sets it) beside its defaults; the one with the highest combined
#      tok/s runs in the later repeats beside the defaults. Runs start until 55% of the time
#      the builds leave is gone (--deadline-s).
#   2. kvcached_latency, kvcached's own scenario (its bench_latency_benefit: ramps 0 -> 20 -> 1
#      requests/s, 256 tokens in and out, engines 45 s apart, 24 GiB of KV), at --scale 0.25
#      (the rate climbs by 4 a second: 100 requests per engine, engines 11 s apart), phases
#      shared and kvcached with its defaults and the best setting of step 1, 3 repeats in
#      rotated order as far as the rest of the time goes.
#   A run that would end past its deadline (judged by the longest of its kind so far) is not
#   started; the summary lists what was skipped. What it leaves out, and a full run adds:
#   scale 1 of both presets and mixed8, the static split, 3 repeats of everything, and the
#   rest of the sweep (reserve1-2, noprealloc, page4, limit67), each a call of its own:
#     scripts/gpu/multi_engine_vs_kvcached.sh OUT/k3_1 -- --preset kvcached3 --kvcached-settings default reserve0 reserve1-2
#     scripts/gpu/multi_engine_vs_kvcached.sh OUT/k3_s -- --preset kvcached3 --phases kvcached --kvcached-settings noprealloc page4 limit50 limit67
#     scripts/gpu/multi_engine_vs_kvcached.sh OUT/k3_2 -- --preset kvcached3 --first-repeat 2 --kvcached-settings default BEST
#     ... the same for --preset kvcached_latency and --preset mixed8, then
#     python3 -m lab.multi_engine.summary OUT/*/results/multi_engine_*.json   (from the tarballs)
# With PRESET...: each preset's default phases once (kvcached with its defaults), one after
# the other within the deadline; demo arguments after -- go to every call (e.g. --scale 0.5,
# --repeats 3, --kvcached-sweep reserve0). With only "-- demo arguments": one demo call.
#
# VKV_MULTI_SMOKE=1 checks this script's logic on a CPU in a few minutes: no GPU, no build
# (PYTHON, default python3, must import vkv; run it from a checkout with the package
# installed), the CPU versions of the presets (tiny models), kvcached's phases not run.
# VKV_BUILD_ONLY=1: vkv, kvcached and FlashInfer only, then kvcached's own check
# (kvcached_build.sh --check) and tests/lab/stores/test_kvcached_store.py (the engine's tokens
# on kvcached's blocks equal a paged pool's; an idle kvcached engine holds its null block's
# page and its reserved pages at most, one idle tick after its requests finish).
# kvcached is built by scripts/gpu/kvcached_build.sh from .whl/kvcached-0.1.6.tar.gz and
# posix_ipc's wheel; FlashInfer comes from scripts/gpu/flashinfer_env.sh (.whl/).
# Writes OUT_DIR/summary.txt (python -m lab.multi_engine.summary: medians [min - max] per
# setup, the goals, per engine TTFT p50 / p99 and the share within 1 s, what the TTFT tail
# comes from, kvcached's sweep, free device memory over the kvcached runs), OUT_DIR/runs.json
# (every run's figures, small) and OUT_DIR/results.tar.gz (the demo's JSON, plots, logs, the GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
src="$PWD"
invocation="$*"
top="${1:?usage: scripts/gpu/multi_engine_vs_kvcached.sh OUT_DIR [PRESET...] [-- demo arguments...]}"
shift
presets=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do presets+=("$1"); shift; done
custom=0
if [ "${1:-}" = "--" ]; then shift; custom=1; fi
deadline="${VKV_DEADLINE_S:-480}"
mkdir -p "$top"
top="$(cd "$top" && pwd)"
out="$top/results"
mkdir -p "$out"
source scripts/gpu/common.sh
status=0
python="${PYTHON:-python3}"
[[ "$python" == */* ]] && python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"  # the steps run from /tmp
device=()
commit="${VKV_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
[ -z "$commit" ] || export VKV_GIT_COMMIT="$commit"
if [ "${VKV_MULTI_SMOKE:-0}" = 1 ]; then
  echo "smoke run on the CPU (VKV_MULTI_SMOKE=1)" | tee "$out/gpu.txt"
  device=(--device cpu)
else
  python=python3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  echo "cores $(nproc); commit ${commit:-unknown}" | tee -a "$out/gpu.txt"
  install_vkv || { echo "build failed"; exit 1; }
  # kvcached and FlashInfer: a phase that cannot run says why in the summary, the rest run.
  if bash scripts/gpu/kvcached_build.sh > "$out/kvcached_build.log" 2>&1; then
    source "${KVCACHED_SITE:-/tmp/kvcached-site}/env.sh"
  fi
  tail -4 "$out/kvcached_build.log"
  source scripts/gpu/flashinfer_env.sh || echo "FlashInfer unavailable: the flashinfer phases say why"
fi
export PYTHONUNBUFFERED=1
echo "=== builds done at ${SECONDS} s"
if [ -n "${VKV_BUILD_ONLY:-}" ]; then  # a first call: the builds (a warm machine keeps them in /tmp) and checks
  step kvcached_check 120 bash "$src/scripts/gpu/kvcached_build.sh" --check
  step kvcached_store_test 300 "$python" -m pytest "$src/tests/lab/stores/test_kvcached_store.py" -q -p no:cacheprovider -rs
  tar czf "$top/results.tar.gz" -C "$top" results && rm -rf "$out"
  exit $status
fi

margin=25  # the summary and the archive, after the last demo call
demo() {  # demo NAME SHARE ARGS...: one demo call, starting runs until SHARE of the time left is gone
  local name="$1" share="$2" left until limit
  shift 2
  left=$(( deadline - margin - SECONDS ))
  until=$("$python" -c "print(int($SECONDS + $left * $share))")
  limit=$(( deadline - margin - SECONDS ))
  if [ "$left" -lt 40 ]; then echo "=== $name: skipped, ${left} s left of VKV_DEADLINE_S"; status=1; return; fi
  # --deadline-s counts from the demo's own start; the timeout (SIGTERM: the demo ends its
  # engines and keeps the JSON of the runs done) stops a run that overruns it.
  step "$name" "$limit" "$python" -m lab.multi_engine --out "$out" --no-progress --deadline-s $(( until - SECONDS )) \
    "${device[@]}" "$@"
}

if [ ${#presets[@]} -eq 0 ] && [ "$custom" = 0 ]; then
  demo multi_kvcached3 0.55 --preset kvcached3 --scale 0.5 --phases shared kvcached --repeats 3 \
    --kvcached-sweep reserve0 limit50
  best="$("$python" - "$out" <<'EOF'
import glob, json, sys
for path in glob.glob(f"{sys.argv[1]}/multi_engine_kvcached3_*.json"):
    best = json.load(open(path)).get("kvcached_best")
    if best and best != "default":
        print(best)
EOF
)"
  echo "=== the best kvcached setting of kvcached3's sweep: ${best:-default}"
  demo multi_kvcached_latency 1.0 --preset kvcached_latency --scale 0.25 --phases shared kvcached --repeats 3 \
    --kvcached-settings default ${best}
elif [ ${#presets[@]} -eq 0 ]; then
  demo multi_custom 1.0 "$@"
else
  for index in "${!presets[@]}"; do
    preset="${presets[$index]}"
    extra=()
    [ "$preset" = h100 ] && extra=(--phases static shared alone)
    # An equal share of what is left to each preset still to run.
    share=$("$python" -c "print(1 / (${#presets[@]} - $index))")
    demo "multi_$preset" "$share" --preset "$preset" "${extra[@]}" "$@"
  done
fi

{
  echo "command: scripts/gpu/multi_engine_vs_kvcached.sh $invocation"
  cat "$out/gpu.txt"
  echo "wall time of the runs: ${SECONDS} s; exit status so far: $status"
  echo
  (cd /tmp && "$python" -m lab.multi_engine.summary "$out"/multi_engine_*.json --json "$top/runs.json") 2>&1 \
    || { status=1; echo "no summary: no result file could be read (the logs are in results.tar.gz)"; }
} > "$top/summary.txt"
cat "$top/summary.txt"
cp "$top/summary.txt" "$top/runs.json" "$out/" 2>/dev/null
tar czf "$top/results.tar.gz" -C "$top" results && rm -rf "$out"
echo "=== done at ${SECONDS} s"
exit $status
