#!/usr/bin/env bash
# On a GPU machine: suspend() / resume() on CUDA. Builds vkv, runs the C++ suspend suites
# on the CUDA backend (fault injection with a busy stream included), the same under
# compute-sanitizer memcheck (an unmap before the copies are done is an illegal address
# there), the Python tests through torch tensors, then the wake-time benchmark: 8 and
# 32 GiB of Llama-3-8B KV (VKV_SKIP_BENCH=1 leaves it out). Logs and JSON in OUT_DIR.
#   scripts/gpu/suspend.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/suspend.sh OUT_DIR}"
mkdir -p "$out"
source scripts/gpu/common.sh
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
echo "commit: $(tree_commit)" | tee "$out/commit.txt"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null &&
  cmake --build build-gpu 2>&1 | tail -2
tests="$PWD/build-gpu/tests/cpp/vkv_tests"
step cpp_suspend 600 "$tests" --gtest_filter='*Suspend*'
grep -q "cuda" "$out/cpp_suspend.log" && ! grep -q "SKIPPED.*cuda" "$out/cpp_suspend.log" ||
  { echo "suspend.sh: the CUDA instances did not run" >&2; status=1; }
step memcheck_suspend 600 compute-sanitizer --tool memcheck --error-exitcode 3 "$tests" \
  --gtest_filter='*Suspend*cuda*'
install_vkv || exit 1
step pytest_suspend 600 python3 -m pytest "$PWD/tests/python/test_suspend.py" -q -p no:cacheprovider -rs
if [ "${VKV_SKIP_BENCH:-0}" != 1 ]; then
  step suspend_cost 1200 python3 -m benchmarks.suspend.suspend_cost --device cuda --gib 8 32 --out "$out"
fi
exit $status
