#!/usr/bin/env bash
# Builds vkv and runs every test: the C++ suites, the install/find_package check, and the
# Python suites against the installed package (CUDA tests skip without a GPU). With
# VKV_TEST_LATEST_TORCH=1 (CI sets it), then builds and tests the Python package again
# against the newest torch vkv supports (scripts/test_latest_torch.sh: a ~5.5 GB download
# the first time, so not by default).
# Usage: scripts/test.sh [--venv] [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
build="${vkv_args[0]:-build}"

bash scripts/bootstrap.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON >/dev/null
cmake --build "$build"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"

# Against the torch already installed: no build isolation, no dependency resolution.
vkv_install
(cd /tmp && "$VKV_PYTHON" -m vkv)
"$VKV_PYTHON" -m pytest tests/python -q -p no:cacheprovider

[ "${VKV_TEST_LATEST_TORCH:-0}" = 0 ] || bash scripts/test_latest_torch.sh
