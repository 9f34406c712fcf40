#!/usr/bin/env bash
# vkv against FlashInfer's paged kernels on a GPU, one part per run (~4-7 minutes each on an
# H100). FlashInfer comes from .whl/ (scripts/gpu/flashinfer_env.sh);
# vkv is built once per machine. Logs and results go to OUT (default: $OUT), folders as
# .tar.gz (few files to copy back from a remote machine).
#   scripts/gpu/flashinfer_kernels.sh PART [OUT]
# PART  smoke    (~4 min) FlashInfer unpacks and imports; the flashinfer store's GPU tests
#                (eager and graph-replayed decode, prefill); one small decode and prefill
#                shape per kernel and model; the demo's flashinfer stores on 16 requests
#       decode   (~6 min) attention_bench --only decode: both models, 4K-64K, batch 1-64
#       prefill  (~6 min) attention_bench --only prefill append (keeps decode's rows, from
#                the same warm machine or from benchmarks/attention/results/attention_h100.json)
#       demo     (~6 min) python -m lab.serving (the gpu preset) and --preset h100, all stores
#       long     (~5 min) --preset long: vkv interleaved against both flashinfer stores and
#                vkv-interleaved-fi (FlashInfer's kernels on vkv's memory)
#       vkvfi    (~7 min) FlashInfer's kernels on vkv's memory: the vkv-*-fi stores' GPU tests
#                (and the flashinfer store's); attention_bench decode on 4 cells per model
#                (one page per request and 128-token pages, both layouts, against FlashInfer
#                paged); --preset h100 with vkv interleaved, vkv-interleaved-fi and both
#                flashinfer stores
set -uo pipefail
cd "$(dirname "$0")/../.."
part="${1:?usage: scripts/gpu/flashinfer_kernels.sh smoke|decode|prefill|demo|long|vkvfi [OUT]}"
out="${2:-${OUT:?no OUT given and \$OUT unset}}"
mkdir -p "$out"
src="$PWD"
export PYTHONUNBUFFERED=1
status=0

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

pack() {  # pack NAME FOLDER: one file back for a folder
  tar czf "$out/$1.tar.gz" -C "$(dirname "$2")" "$(basename "$2")" && rm -rf "$2"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
install_vkv || exit 1
# shellcheck source=scripts/gpu/flashinfer_env.sh
source scripts/gpu/flashinfer_env.sh || exit 1
bench=(python3 -m benchmarks.attention.attention_bench)
case "$part" in
  smoke)
    step pytest_flashinfer_store 240 python3 -m pytest "$src/tests/lab/stores/test_flashinfer_store.py" -q -p no:cacheprovider -rs
    step bench_smoke 300 "${bench[@]}" --only decode prefill --batches 2 --contexts 4096 --rounds 1 --target-ms 1 \
      --flex eager --out "$out/smoke"
    step demo_flashinfer_graphs 200 python3 -m lab.serving --preset h100 --requests 16 --max-slots 32 --no-progress \
      --stores vkv-interleaved flashinfer-16 flashinfer-128
    # Kernels FlashInfer compiled here, not shipped compiled in the archive (empty: none).
    find "$FLASHINFER_WORKSPACE_BASE" -name "*.so" 2>/dev/null | tee "$out/jit_compiled.txt"
    pack smoke "$out/smoke" ;;
  decode|prefill)
    # Outside the tree, which may be copied anew for each run: a machine kept between runs keeps
    # decode's rows for prefill's run; on a fresh one, the tree's benchmarks/attention/results file is the start.
    results=/tmp/attention-results
    mkdir -p "$results"
    [ -f "$results/attention_h100.json" ] || cp benchmarks/attention/results/attention_h100.json "$results/" 2>/dev/null
    sections=$([ "$part" = decode ] && echo decode || echo "prefill append")
    # shellcheck disable=SC2086
    step "attention_$part" 480 "${bench[@]}" --only $sections --out "$results"
    cp "$results/attention_h100.json" "$out/" ;;
  demo)
    step demo_default 120 python3 -m lab.serving --no-progress --out "$out/results"
    step serving_h100 360 python3 -m lab.serving --preset h100 --no-progress --out "$out/results"
    pack results "$out/results" ;;
  long)
    step serving_long 480 python3 -m lab.serving --preset long --no-progress --out "$out/results" \
      --stores vkv-interleaved flashinfer-16 flashinfer-128 vkv-interleaved-fi-128
    pack results "$out/results" ;;
  vkvfi)
    step pytest_vkv_flashinfer 120 python3 -m pytest "$src/tests/lab/stores/test_vkv_flashinfer.py" \
      "$src/tests/lab/stores/test_flashinfer_store.py" -q -p no:cacheprovider -rs
    step attention_vkvfi 150 "${bench[@]}" --only decode --cells 1x16384 1x65536 16x16384 64x16384 \
      --out "$out/attention"
    step serving_vkvfi 280 python3 -m lab.serving --preset h100 --no-progress --out "$out/results" \
      --stores vkv-interleaved vkv-interleaved-fi-128 flashinfer-16 flashinfer-128
    pack attention "$out/attention"
    pack results "$out/results" ;;
  *)
    echo "unknown part $part"
    exit 2 ;;
esac
exit $status
