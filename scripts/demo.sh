#!/usr/bin/env bash
# Installs what the demo needs, builds and installs the vkv Python package, prints what was
# built (python -m vkv), and runs the demo (python -m vkv.demo) on the default
# backend: GPU if present, else host. On an externally managed Python (Debian's, Ubuntu's)
# or with VKV_VENV=1 / --venv, all of it goes into .venv.
# Extra arguments go to the demo: scripts/demo.sh --iterations 500
# The full comparison (a model, paged caches, FlashInfer) runs from the checkout: python -m lab.serving
# The C++ walk-through of the core API: cmake --build build --target vkv_demo && ./build/vkv_demo
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
bash scripts/bootstrap.sh --demo
vkv_install
cd /tmp  # import the installed package, not the source tree
"$VKV_PYTHON" -m vkv
echo
"$VKV_PYTHON" -m vkv.demo "${vkv_args[@]}"
