#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to build and test vkv. Idempotent:
# checks first, installs only what is missing, so it costs nothing the second time.
#   scripts/bootstrap.sh [--demo] [--lint] [--venv]
#     --demo: only what scripts/demo.sh needs (no GoogleTest, Google Benchmark, test packages)
#     --lint: also clang-format, ruff and mypy (scripts/lint.sh)
#     --venv (or VKV_VENV=1): use .venv even where the system Python is not externally managed
# Python packages go to the Python scripts/python_env.sh picks (a .venv on an externally
# managed Python). It says what it installs, and why, before it does.
#   VKV_TORCH_CPU_INDEX: where a machine without an NVIDIA GPU gets torch's CPU build
#     (default https://download.pytorch.org/whl/cpu; unreachable in 5 s: PyPI's torch).
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

# torch 2.13 and 2.14 need Python 3.10 or newer: the Python vkv goes into (an active or
# existing venv's), else the one a new .venv is made from.
python_checked="$VKV_PYTHON"
[ -x "$python_checked" ] || python_checked="$vkv_base_python"
if ! "$python_checked" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "bootstrap: vkv needs Python 3.10 or newer; $python_checked is" \
    "$("$python_checked" --version 2>&1) (VKV_BASE_PYTHON=python3.12 picks another)" >&2
  exit 1
fi

apt_install() {
  local sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo "
  echo "bootstrap: running ${sudo_cmd}apt-get install $* (the system packages below are missing):"
  printf '  %s\n' "${missing_why[@]}"
  [ -z "$sudo_cmd" ] || echo "bootstrap: sudo may ask for your password"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$@" >/dev/null
}

missing=() missing_why=()
need() { missing+=("$1"); missing_why+=("$1: $2"); }
command -v cmake >/dev/null || need cmake "configures the C++ build"
command -v ninja >/dev/null || need ninja-build "runs the C++ build"
command -v g++ >/dev/null || need g++ "compiles the C++ core and the Python bindings"
if [ "$demo" = 0 ]; then
  [ -f /usr/include/gtest/gtest.h ] || need libgtest-dev "the C++ tests (GoogleTest)"
  [ -f /usr/include/benchmark/benchmark.h ] || need libbenchmark-dev "the C++ benchmarks (Google Benchmark)"
fi
# Debian splits venv's pip bootstrap (ensurepip) into python3-venv.
if [[ "$VKV_PYTHON" == "$vkv_root/.venv/"* ]] && [ ! -x "$VKV_PYTHON" ] &&
  ! "$vkv_base_python" -c "import ensurepip" 2>/dev/null; then
  need python3-venv "creates .venv ($vkv_venv_reason)"
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

# Python side. An installed torch is kept (the releases vkv supports: python/vkv/_torch_support.py;
# `import vkv` names the one to install where it is too old). Otherwise
# torch 2.13.0: PyPI's build for Linux is the CUDA one, which brings ~3 GB of nvidia-*
# libraries; on a machine without an NVIDIA GPU, the CPU build from PyTorch's own index
# (~200 MB) instead, where that index answers within 5 s (else PyPI's, as on a GPU machine).
torch_version=2.13.0
have() { "$VKV_PYTHON" -c "import $1" 2>/dev/null; }
if ! have torch; then
  cpu_index="${VKV_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  if command -v nvidia-smi >/dev/null || [ -e /dev/nvidia0 ]; then
    echo "bootstrap: installing torch==$torch_version from PyPI: its CUDA build, with its nvidia-* libraries (~3 GB)"
    "$VKV_PYTHON" -m pip install -q "torch==$torch_version"
  elif timeout 10 "$VKV_PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
    "$cpu_index" 2>/dev/null; then
    echo "bootstrap: no NVIDIA GPU here: installing torch==$torch_version's CPU build from $cpu_index (~200 MB)"
    "$VKV_PYTHON" -m pip install -q --index-url "$cpu_index" --extra-index-url https://pypi.org/simple \
      "torch==$torch_version"
  else
    echo "bootstrap: no NVIDIA GPU here, but $cpu_index did not answer within 5 s: installing" \
      "torch==$torch_version from the configured index (on PyPI the CUDA build, ~3 GB with its nvidia-* libraries)"
    "$VKV_PYTHON" -m pip install -q "torch==$torch_version"
  fi
fi

python_missing=()
for module in numpy scikit_build_core pybind11 tqdm; do
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
# The linters at the versions .pre-commit-config.yaml pins (one source for CI, scripts/lint.sh
# and pre-commit): ruff, and clang-format from PyPI unless the one on PATH is that version.
if [ "$lint" = 1 ]; then
  have mypy || python_missing+=(mypy)
  ruff_version="$(vkv_pinned_version ruff)"
  [ "$("$VKV_PYTHON" -m ruff --version 2>/dev/null | cut -d' ' -f2)" = "$ruff_version" ] ||
    python_missing+=("ruff==$ruff_version")
  clang_format_version="$(vkv_pinned_version clang-format)"
  [ "$(vkv_clang_format_version "$(vkv_clang_format)")" = "$clang_format_version" ] ||
    python_missing+=("clang-format==$clang_format_version")
fi
if [ ${#python_missing[@]} -gt 0 ]; then
  echo "bootstrap: pip installing ${python_missing[*]} into $VKV_PYTHON"
  start=$SECONDS
  "$VKV_PYTHON" -m pip install -q "${python_missing[@]}"
  echo "bootstrap: installed in $((SECONDS - start)) s"
fi
