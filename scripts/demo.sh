#!/usr/bin/env bash
# Builds vkv and runs the demo on the default backend (CUDA with a GPU, host without).
# Extra arguments go to the demo: scripts/demo.sh --layout per_layer --device host
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
cmake -S . -B build -G Ninja >/dev/null
cmake --build build --target vkv_demo >/dev/null
./build/vkv_demo "$@"
