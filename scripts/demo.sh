#!/usr/bin/env bash
# Installs what is missing, builds and installs the vkv Python package, and runs the
# serving demo (python -m vkv.demo) on the default backend: GPU if present, else host.
# Extra arguments go to the demo: scripts/demo.sh --stores vkv-interleaved static
# The C++ walk-through of the core API: cmake --build build --target vkv_demo && ./build/vkv_demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
python3 -m pip install -q --no-build-isolation --no-deps .
cd /tmp  # import the installed package, not the source tree
python3 -m vkv.demo "$@"
