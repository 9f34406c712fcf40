#!/usr/bin/env bash
# On a GPU machine: builds vkv, runs every test (CUDA suites included), the demos on the GPU
# (the C++ walk-through, python -m vkv.demo, the lab's default serving run) and the map-cost
# benchmark, and leaves logs and JSON in OUT_DIR.
#   scripts/gpu/all_tests.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/all_tests.sh OUT_DIR}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null && cmake --build build-gpu 2>&1 | tail -3
status=0
ctest --test-dir build-gpu --output-on-failure -j4 2>&1 | tee "$out/ctest.log" | grep -E "tests passed|Failed|FAILED|Skipped" || true
grep -q "100% tests passed" "$out/ctest.log" || status=1
python3 -m pip install -q --no-build-isolation --no-deps . > "$out/pip.log" 2>&1 \
  || { tail -30 "$out/pip.log"; echo "all_tests.sh: pip install failed" >&2; exit 1; }
(cd /tmp && PYTHONUNBUFFERED=1 python3 -m pytest "$OLDPWD/tests/python" "$OLDPWD/tests/lab" "$OLDPWD/tests/benchmarks" \
  -q -p no:cacheprovider -rs 2>&1) | tee "$out/pytest.log" | tail -15
grep -qE "[0-9]+ passed" "$out/pytest.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/pytest.log" || status=1
# A demo that fails (an exception, a store that failed) fails the check; pipefail carries
# its exit status through tail and tee.
./build-gpu/vkv_demo --device cuda:0 2>&1 | tail -6 | tee "$out/demo.log" || status=1
(cd /tmp && python3 -m vkv.demo --device cuda 2>&1) | tail -10 | tee "$out/vkv_demo.log" || status=1
(python3 -m lab.serving --device cuda --no-progress 2>&1) | tail -12 | tee "$out/serving_demo.log" || status=1
./build-gpu/benchmarks/vkv_map_cost --device cuda:0 --out "$out/map_cost_h100.json" 2>&1 | tee "$out/map_cost.log"
exit $status
