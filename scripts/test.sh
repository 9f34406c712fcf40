#!/usr/bin/env bash
# Builds vkv and runs every test: the C++ suites, the install/find_package check, and the
# Python suites against the installed package (CUDA tests skip without a GPU). With
# VKV_TEST_LATEST_TORCH=1 (CI sets it), then builds and tests the Python package again
# against the newest torch vkv supports (scripts/test_latest_torch.sh: a ~5.5 GB download
# the first time, so not by default).
# VKV_TEST_TRANSFORMERS_VERSIONS=1 (CI sets it too) tests the oldest and the newest
# supported transformers 5.x as well (scripts/test_transformers_versions.sh).
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
# vLLM 0.33 without its CUDA dependencies, so tests/python/test_vllm*.py run (never skip) here.
PYTHON="$VKV_PYTHON" bash scripts/install_vllm.sh
"$VKV_PYTHON" -m pytest tests/python -q -p no:cacheprovider

# CI: the oldest and the newest transformers 5.x, each in a throwaway venv over this torch.
[ "${VKV_TEST_TRANSFORMERS_VERSIONS:-0}" = 0 ] || PYTHON="$VKV_PYTHON" bash scripts/test_transformers_versions.sh
[ "${VKV_TEST_LATEST_TORCH:-0}" = 0 ] || bash scripts/test_latest_torch.sh
