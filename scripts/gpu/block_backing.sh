#!/usr/bin/env bash
# The block-backing layer on a GPU, ~5 minutes after the build: its C++ suite on CUDA (the
# job's ordering behind a held stream, zero-fills, every backend's variant), the same
# suite's CUDA variants under compute-sanitizer memcheck, and tests/python/test_block_backing.py
# (its CUDA test writes through the tensor into backed blocks). Results: $OUT/summary.txt
# and one log per stage.
#   scripts/gpu/block_backing.sh OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
out="${1:?usage: scripts/gpu/block_backing.sh OUT}"
mkdir -p "$out"
src="$(pwd)"
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "commit $(tree_commit)"
} | tee "$out/summary.txt"
install_vkv > "$out/pip.log" 2>&1 &  # once per machine and tree; says why where it fails
pip_pid=$!
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON -DVKV_BUILD_BENCHMARKS=OFF \
  -DVKV_BUILD_EXAMPLES=OFF >/dev/null && cmake --build build-gpu --target vkv_tests -j12 2>&1 | tail -1
wait $pip_pid || { cat "$out/pip.log"; exit 1; }
filter='*Block*:*PageCounts*'
timeout 300 build-gpu/tests/cpp/vkv_tests --gtest_filter="$filter" > "$out/cpp.log" 2>&1
rc=$?
echo "C++ block suites (CUDA variants included): exit $rc, $(grep -cE '^\[       OK \]' "$out/cpp.log") passed," \
  "$(grep -c 'SKIPPED \]' "$out/cpp.log") skipped" | tee -a "$out/summary.txt"
[ $rc -eq 0 ] || status=1
(cd /tmp && timeout 240 python3 -m pytest "$src/tests/python/test_block_backing.py" -q -p no:cacheprovider -rs \
  2>&1) > "$out/pytest.log"
rc=$?
echo "pytest test_block_backing.py: exit $rc, $(tail -1 "$out/pytest.log")" | tee -a "$out/summary.txt"
[ $rc -eq 0 ] || status=1
if command -v compute-sanitizer >/dev/null; then
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 build-gpu/tests/cpp/vkv_tests \
    --gtest_filter='*Block*cuda*' > "$out/memcheck_cpp.log" 2>&1
  rc=$?
  echo "memcheck over the C++ block suites' CUDA variants: exit $rc, $(grep 'ERROR SUMMARY' "$out/memcheck_cpp.log" | tail -1)" \
    | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
  (cd /tmp && timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest \
    "$src/tests/python/test_block_backing.py" -q -p no:cacheprovider -k cuda 2>&1) > "$out/memcheck_py.log"
  rc=$?
  echo "memcheck over the Python CUDA test: exit $rc, $(grep 'ERROR SUMMARY' "$out/memcheck_py.log" | tail -1)" \
    | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || status=1
else
  echo "compute-sanitizer not installed: memcheck skipped" | tee -a "$out/summary.txt"
fi
exit $status
