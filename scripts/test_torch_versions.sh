#!/usr/bin/env bash
# Installs ONE vkv wheel, unchanged, into a virtual environment per torch release and runs
# `python -m vkv` and the Python suites against the installed wheel (never the checkout): by
# default the oldest and the newest release vkv supports (python/vkv/_torch_support.py).
#
#   scripts/test_torch_versions.sh WHEEL [RELEASE ...]     e.g. ... dist/vkv-0.1.0-cp311-*.whl 2.11 2.15
#
# Each environment, of the wheel's CPython, gets PyPI's torch==RELEASE.* (a CUDA build: the
# newest brings ~3 GB of nvidia-* libraries), numpy and the test packages, and is kept in
# VKV_TORCH_VENVS (default ~/.cache/vkv/torch-venvs) for the next run. To save a second
# download, the older releases borrow the newest's CUDA libraries where torch then imports
# (the same CUDA 13 sonames; a newer minor release of a CUDA library keeps its ABI; without a
# GPU they are only loaded); where it does not, they get their own.
#
# The suites: all but the serving demo's and the attention benchmark's (pure Python over the
# same bindings, the slowest: minutes on 2 cores; they run in scripts/test.sh's pass) and
# vLLM's (vLLM pins its own torch: scripts/test_engine_env.sh). VKV_TORCH_VERSIONS_ALL=1 runs
# every suite. Exit 1 if any release fails.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 1 ] && [ -f "$1" ] || { echo "usage: scripts/test_torch_versions.sh WHEEL [RELEASE ...]" >&2; exit 2; }
wheel="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
shift
releases=("$@")
if [ ${#releases[@]} -eq 0 ]; then
  mapfile -t releases < <(python3 - "$root/python/vkv/_torch_support.py" <<'PY'
import runpy, sys
support = runpy.run_path(sys.argv[1])
print(support["name"](support["OLDEST"]))
print(support["name"](support["NEWEST_TESTED"]))
PY
  )
fi
# The CPython the wheel is for (cp311 -> python3.11).
python="$(basename "$wheel" | sed -n 's/.*-cp\([0-9]\)\([0-9]*\)-cp[0-9]*-.*/python\1.\2/p')"
command -v "$python" >/dev/null || { echo "test_torch_versions: the wheel is for $python, which is not on PATH" >&2; exit 2; }
venvs="${VKV_TORCH_VENVS:-$HOME/.cache/vkv/torch-venvs}"
mkdir -p "$venvs"
packages=(numpy pytest hypothesis "transformers==5.17.0")
suites=(tests/python tests/lab tests/benchmarks)
ignore=(--ignore=tests/lab/serving/test_demo.py --ignore=tests/lab/serving/test_demo_cuda_graphs.py
        --ignore=tests/benchmarks/attention/test_attention_bench.py --ignore=tests/python/integrations/vllm_connector)
[ "${VKV_TORCH_VERSIONS_ALL:-0}" = 0 ] || ignore=()

# Newest first: the others borrow its CUDA libraries.
mapfile -t releases < <(printf '%s\n' "${releases[@]}" | sort -rV)
has_torch() { "$venv/bin/python" -c "import sys, torch; sys.exit(not torch.__version__.startswith('$release.'))" 2>/dev/null; }
donor="" donor_site="" failed=()
for release in "${releases[@]}"; do
  start=$SECONDS venv="$venvs/torch-$release"
  if ! has_torch; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if [ -n "$donor" ]; then
      echo "== torch $release: installing, with torch $donor's CUDA libraries"
      "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "torch==$release.*"
      "$venv/bin/python" -m pip install -q --disable-pip-version-check filelock typing-extensions sympy networkx \
        jinja2 fsspec setuptools
      ln -s "$donor_site/nvidia" "$site/nvidia"
      has_torch || { echo "== torch $release: does not import so; installing its own CUDA libraries"; rm "$site/nvidia"; }
    fi
    has_torch || { echo "== torch $release: installing"; "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$release.*"; }
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${packages[@]}"
  fi
  [ -n "$donor" ] || donor="$release" donor_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
  version="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  echo "== torch $version: ready in $((SECONDS - start)) s; python -m vkv:"
  (cd /tmp && "$venv/bin/python" -m vkv) | sed 's/^/   /'
  if (cd "$root" && "$venv/bin/python" -m pytest "${suites[@]}" -q -p no:cacheprovider "${ignore[@]}"); then
    echo "== torch $version: passed in $((SECONDS - start)) s"
  else
    echo "== torch $version: FAILED ($((SECONDS - start)) s)"
    failed+=("$version")
  fi
done
[ ${#failed[@]} -eq 0 ] || { echo "test_torch_versions: failed with torch ${failed[*]}" >&2; exit 1; }
