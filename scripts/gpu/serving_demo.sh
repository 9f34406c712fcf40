#!/usr/bin/env bash
# The serving demos on a GPU in one run: build, the CUDA-graph test (plain and under
# compute-sanitizer memcheck), the default demos (python -m vkv.demo, what scripts/demo.sh
# runs, then the lab's python -m lab.serving), a decode-step profile and the benchmark presets. Logs go to OUT_DIR, JSON and plots to OUT_DIR/results.
#   scripts/gpu/serving_demo.sh OUT_DIR [STAGE...]
# Stages run in the order given (default: build test sanitize default profile h100 long);
#   h100-quick: the h100 preset on vkv-interleaved and static only (a smoke run).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/serving_demo.sh OUT_DIR [STAGE...]}"
shift
stages="${*:-build test sanitize default profile h100 long}"
mkdir -p "$out/results"
src="$PWD"
export PYTHONUNBUFFERED=1
status=0

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

python_info() {
  (cd /tmp && python3 -c 'import torch, vkv
print("torch", torch.__version__, "cuda", torch.version.cuda, "vkv", vkv.__file__)
print(torch.ops.aten._flash_attention_forward.default._schema)') 2>&1 | tee "$out/torch.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
for stage in $stages; do
  case "$stage" in
    build)
      echo "=== build ($(date +%T))"
      install_vkv || exit 1
      python_info ;;
    test)
      step test 200 python3 -m pytest "$src/tests/lab/serving/test_demo_cuda_graphs.py" -q -p no:cacheprovider -rs ;;
    sanitize)
      step memcheck_demo_graphs 180 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest "$src/tests/lab/serving/test_demo_cuda_graphs.py" -q -p no:cacheprovider -k vkv ;;
    default)
      step vkv_demo 120 python3 -m vkv.demo --device cuda
      step demo_default 120 python3 -m lab.serving --no-progress ;;
    profile)
      step serving_step_profile 200 python3 -m benchmarks.serving.serving_step_profile --out "$out/results" ;;
    h100-quick)
      step serving_h100_quick 150 python3 -m lab.serving --preset h100 --stores vkv-interleaved static --no-progress ;;
    h100)
      step serving_h100 400 python3 -m lab.serving --preset h100 --no-progress --out "$out/results" ;;
    long)  # vkv per-layer serves these prompts as vkv interleaved does (see serving_long in docs)
      step serving_long_h100 400 python3 -m lab.serving --preset long --no-progress --out "$out/results" \
        --stores vkv-interleaved paged-16 paged-128 static ;;
    eager)  # the engine without CUDA graphs, on the same machine: what the graphs bring
      step serving_h100_eager 200 python3 -m lab.serving --preset h100 --stores vkv-interleaved --no-cuda-graphs \
        --no-progress --out "$out/eager" ;;
    *)
      echo "unknown stage $stage"
      status=1 ;;
  esac
done
exit $status
