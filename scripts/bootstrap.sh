#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build and test vkv. Idempotent:
# checks first, installs only what is missing, so it costs nothing the second time.
set -euo pipefail

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
[ -f /usr/include/benchmark/benchmark.h ] || missing+=(libbenchmark-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python side. torch is pinned to the CPU build this project's machines carry as a local
# file; any other torch spec would download gigabytes of CUDA packages. Where a torch is
# already installed (a GPU machine), it is kept.
python_missing=()
python3 -c "import torch" 2>/dev/null || python_missing+=("torch==2.13.0")
for module in numpy pytest hypothesis scikit_build_core ; do
  python3 -c "import $module" 2>/dev/null || python_missing+=("${module//_/-}")
done
# The transformers integration's tests (a test extra in pyproject.toml); an installed
# transformers is kept.
python3 -c "import transformers" 2>/dev/null || python_missing+=("transformers==5.17.0")
if [ ${#python_missing[@]} -gt 0 ]; then
  echo "bootstrap: pip installing ${python_missing[*]}"
  python3 -m pip install -q "${python_missing[@]}"
fi
