#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build and test vkv. Idempotent:
# checks first, installs only what is missing, so it costs nothing the second time.
#   scripts/bootstrap.sh [--demo] [--lint] [--venv]
#     --demo: only what scripts/demo.sh needs (no GoogleTest, Google Benchmark, test packages)
#     --lint: also clang-format, ruff and mypy (scripts/lint.sh)
#     --venv (or VKV_VENV=1): use .venv even where the system Python is not externally managed
# Python packages go to the Python scripts/python_env.sh picks (a .venv on an externally
# managed Python).
set -euo pipefail
source "$(dirname "$0")/python_env.sh"
demo=0 lint=0
for arg in "${vkv_args[@]}"; do
  case "$arg" in
    --demo) demo=1 ;;
    --lint) lint=1 ;;
    *) echo "bootstrap: unknown argument $arg (expected --demo, --lint, --venv)" >&2; exit 2 ;;
  esac
done

apt_install() {
  echo "bootstrap: installing $*"
  local sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$@" >/dev/null
}

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
if [ "$demo" = 0 ]; then
  [ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  [ -f /usr/include/benchmark/benchmark.h ] || missing+=(libbenchmark-dev)
fi
[ "$lint" = 0 ] || command -v clang-format >/dev/null || missing+=(clang-format)
# Debian splits venv's pip bootstrap (ensurepip) into python3-venv.
if [[ "$VKV_PYTHON" == "$vkv_root/.venv/"* ]] && [ ! -x "$VKV_PYTHON" ] &&
  ! "$vkv_base_python" -c "import ensurepip" 2>/dev/null; then
  missing+=(python3-venv)
fi
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"

# The virtual environment, made once. It sees the system's packages when the system Python
# has torch (kept: a GPU machine's CUDA build); otherwise it is empty and gets torch below.
if [[ "$VKV_PYTHON" == "$vkv_root/.venv/"* ]] && [ ! -x "$VKV_PYTHON" ]; then
  if "$vkv_base_python" -c "import torch" 2>/dev/null; then
    echo "bootstrap: $vkv_venv_reason: creating .venv, with the system's torch"
    "$vkv_base_python" -m venv --system-site-packages "$vkv_root/.venv"
  else
    echo "bootstrap: $vkv_venv_reason: creating .venv"
    "$vkv_base_python" -m venv "$vkv_root/.venv"
  fi
fi
[[ "$VKV_PYTHON" != "$vkv_root/.venv/"* ]] || echo "bootstrap: using $vkv_root/.venv ($vkv_venv_reason)"

# Python side. torch is pinned to the CPU build this project's machines carry as a local
# file; any other torch spec would download gigabytes of CUDA packages. Where a torch is
# already installed (a GPU machine), it is kept. vkv supports torch 2.11 to 2.14.
python_missing=()
have() { "$VKV_PYTHON" -c "import $1" 2>/dev/null; }
have torch || python_missing+=("torch==2.13.0")
for module in numpy scikit_build_core tqdm; do
  have "$module" || python_missing+=("${module//_/-}")
done
# scikit-build-core needs CMake 3.25; an older system cmake is passed over for PyPI's.
cmake_version="$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
if [ "$(printf '%s\n' 3.25 "${cmake_version:-0}" | sort -V | head -n1)" != 3.25 ] && ! have cmake; then
  python_missing+=("cmake>=3.25")
fi
if [ "$demo" = 0 ]; then
  for module in pytest hypothesis; do have "$module" || python_missing+=("$module"); done
  # The transformers integration's tests (the test extra in pyproject.toml); an installed
  # transformers is kept.
  have transformers || python_missing+=("transformers==5.17.0")
fi
if [ "$lint" = 1 ]; then
  for module in ruff mypy; do have "$module" || python_missing+=("$module"); done
fi
if [ ${#python_missing[@]} -gt 0 ]; then
  echo "bootstrap: pip installing ${python_missing[*]}"
  start=$SECONDS
  "$VKV_PYTHON" -m pip install -q "${python_missing[@]}"
  echo "bootstrap: installed in $((SECONDS - start)) s"
fi
