#!/usr/bin/env bash
# vkv against FlashInfer on equal work (benchmarks/serving/NOTES.md), one part per run (each
# under 9 minutes on a fresh H100, vkv's build and FlashInfer's unpacking included).
# FlashInfer comes from .whl/ (scripts/gpu/flashinfer_env.sh). Logs and results go to OUT (default
# $OUT), folders as .tar.gz; each part ends with its goal table (summary.txt).
#   scripts/gpu/fair_comparisons.sh PART [OUT]
# PART  h100    python -m lab.serving --preset h100 --repeats 3 (store order rotated each
#               repeat) over vkv-interleaved, vkv-interleaved-fi-128, flashinfer-16 and
#               flashinfer-128: tok/s and TTFT p50 median and range, the best vkv store
#               against the best FlashInfer store (goal: >= 1.03x tok/s, TTFT p50 <=)
#       long    the same with --preset long, its P:D 500 and 100 traces (every store
#               prefills fresh prompts with the same kind of kernel: PyTorch's FlashAttention-2
#               varlen for vkv-interleaved, FlashInfer's ragged FA3 for the three others)
#       long50  the same, its P:D 50 trace (the longest: 4 stores x 3 repeats of all three
#               traces take ~7 minutes of runs alone, past 9 minutes on a fresh machine)
#       decode  attention_bench --only decode on the cells the docs quote (both models,
#               1x16K 1x64K 16x16K 64x16K), then plot_attention.py's decode tables: both
#               vkv layouts labelled, flash_varlen beside sdpa_default
# VKV_FAIR_BENCH_REPEATS (default 3) sets the repeats; VKV_FAIR_BENCH_ARGS adds demo
# options (e.g. "--vkv-ready-pct 75", "--large-page-mib 0": the vkv stores' memory). VKV_FAIR_BENCH_SMOKE=1 checks the
# script's logic on a CPU in a minute: no GPU, no build (PYTHON, default python3, must
# import vkv), no FlashInfer needed (its stores are skipped), tiny presets.
set -uo pipefail
cd "$(dirname "$0")/../.."
part="${1:?usage: scripts/gpu/fair_comparisons.sh h100|long|long50|decode [OUT]}"
out="$(mkdir -p "${2:-${OUT:?no OUT given and \$OUT unset}}" && cd "${2:-$OUT}" && pwd)"
src="$PWD"
export PYTHONUNBUFFERED=1
smoke="${VKV_FAIR_BENCH_SMOKE:-0}"
repeats="${VKV_FAIR_BENCH_REPEATS:-3}"
read -r -a extra <<< "${VKV_FAIR_BENCH_ARGS:-}"
python="${PYTHON:-python3}"
status=0
stores=(vkv-interleaved vkv-interleaved-fi-128 flashinfer-16 flashinfer-128)

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

pack() {  # pack NAME FOLDER: one file back for a folder
  [ -d "$2" ] && tar czf "$out/$1.tar.gz" -C "$(dirname "$2")" "$(basename "$2")" && rm -rf "$2"
}

summary() {  # summary LOG: the goal table's lines of a demo log, into summary.txt
  {
    echo "== $part ($(cat "$out/gpu.txt" 2>/dev/null)), commit $(tree_commit)"
    sed -n '/repeats, store order rotated/,$p' "$1" | grep -E '^\||^goal|repeats, store order' || echo "no repeats table in $1"
  } | tee -a "$out/summary.txt"
}

if [ "$smoke" = 1 ]; then
  echo "smoke run on the CPU (VKV_FAIR_BENCH_SMOKE=1)" | tee "$out/gpu.txt"
  device=(--device cpu)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  device=()
  python=python3
  install_vkv || exit 1
  # shellcheck source=scripts/gpu/flashinfer_env.sh
  source scripts/gpu/flashinfer_env.sh || { echo "fair_comparisons.sh: FlashInfer is not available: the comparison needs it" >&2; exit 1; }
fi

case "$part" in
  h100|long|long50)
    case "$part" in h100) ratios=() ;; long) ratios=(--pd-ratios 500 100) ;; long50) ratios=(--pd-ratios 50) ;; esac
    if [ "$smoke" = 1 ]; then  # the small preset's model and budget, the part's shape of run
      preset=(--preset small --requests 6 --stores "${stores[@]}" static)
      [ "$part" = h100 ] && preset+=(--vkv-ready-pct 50)
      [ "$part" != h100 ] && preset+=("${ratios[@]}" --max-context 1024 --max-prefill-tokens 1024)
    else
      preset=(--preset "${part%50}" --stores "${stores[@]}" "${ratios[@]}")
    fi
    step "serving_$part" 450 "$python" -m lab.serving "${device[@]}" "${preset[@]}" --repeats "$repeats" --no-progress \
      --out "$out/results" "${extra[@]}"
    summary "$out/serving_$part.log"
    pack results "$out/results" ;;
  decode)
    if [ "$smoke" = 1 ]; then
      cells=(--quick)
    else
      cells=(--cells 1x16384 1x65536 16x16384 64x16384)
    fi
    step attention_decode 420 "$python" -m benchmarks.attention.attention_bench "${device[@]}" --only decode "${cells[@]}" \
      --out "$out/attention"
    json=$(ls "$out"/attention/attention_*.json 2>/dev/null | head -1)
    if [ -n "$json" ]; then
      { echo "== decode ($(cat "$out/gpu.txt")), commit $(tree_commit)"
        "$python" -m benchmarks.attention.attention_summary "$json" || status=1; } | tee "$out/summary.txt"
      # Every table and the plots (needs matplotlib): FlashInfer's decode on vkv per layout.
      step plot_attention 60 "$python" -m benchmarks.attention.plot_attention "$json"
    else
      echo "no attention JSON written" | tee "$out/summary.txt"
      status=1
    fi
    pack attention "$out/attention" ;;
  *)
    echo "unknown part $part"
    exit 2 ;;
esac
echo "fair_bench $part: exit $status"
exit $status
