#!/usr/bin/env bash
# On a GPU machine: the shared budget's edge cases where a GPU changes the outcome. Builds vkv,
# runs the shared budget's C++ suites on the CUDA backend (a squatted, widened, truncated
# or corrupted object; a stopped lock holder), the Python shared-budget and bad-input
# tests, printing/pickling/copying cache views on CUDA (test_view_copies: an unmapped
# read there would end the CUDA context) and the tensor-parallel wrappers over gloo and
# shared memory. About 5 minutes on an H100.
#   scripts/gpu/shared_budget_edges.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/shared_budget_edges.sh OUT_DIR}"
mkdir -p "$out"
src="$PWD"
source scripts/gpu/common.sh
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON >/dev/null \
  && cmake --build build-gpu 2>&1 | tail -2
step cpp_shared_budget 240 "$src/build-gpu/tests/cpp/vkv_tests" \
  --gtest_filter='*SharedBudget*:SharedMapping*:RobustMutex*:ProcessIdentity*:Futex*'
install_vkv
step view_copies 240 python3 -m pytest "$src/tests/python/test_view_copies.py" -q -p no:cacheprovider -rs
step shared_budget 300 python3 -m pytest "$src/tests/python/test_shared_budget.py" -q -p no:cacheprovider -rs
step distributed 300 python3 -m pytest "$src/tests/python/test_distributed.py" -q -p no:cacheprovider -rs
exit $status
