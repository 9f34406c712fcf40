#!/usr/bin/env bash
# Checked mode on a GPU, ~2 minutes after the build: the C++ AccessChecks suite on CUDA
# (explain() names CUDA addresses, freed slots keep no pages, nothing is mapped ahead) and
# tests/python/test_checked.py, whose CUDA tests check that a freed slot's write faults only
# in checked mode and that vkv.explain_address() names the address compute-sanitizer reports
# (skipped where compute-sanitizer is not installed). Results: $OUT/*.log, $OUT/summary.txt.
#   scripts/gpu/checked_mode.sh OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
out="${1:?usage: scripts/gpu/checked_mode.sh OUT}"
mkdir -p "$out"
src="$(pwd)"
status=0
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
install_vkv > "$out/pip.log" 2>&1 &  # once per machine and tree; says why where it fails
pip_pid=$!
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON -DVKV_BUILD_BENCHMARKS=OFF \
  -DVKV_BUILD_EXAMPLES=OFF >/dev/null && cmake --build build-gpu --target vkv_tests -j12 2>&1 | tail -1
wait $pip_pid || { tail -30 "$out/pip.log"; exit 1; }
step cpp 120 "$src/build-gpu/tests/cpp/vkv_tests" --gtest_filter='*AccessChecks*:*CheckedHost*:CheckedMode*'
step pytest 400 python3 -m pytest "$src/tests/python/test_checked.py" -q -p no:cacheprovider -rs
{
  echo "commit $(tree_commit); GPU $(cat "$out/gpu.txt")"
  grep -h -E "^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test" "$out/cpp.log"
  tail -1 "$out/pytest.log"
  grep -h "SKIPPED" "$out/pytest.log"
} > "$out/summary.txt"
cat "$out/summary.txt"
exit $status
