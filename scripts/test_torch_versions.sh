#!/usr/bin/env bash
# Installs ONE vkv wheel, unchanged, into a virtual environment per torch release and runs
# `python -m vkv` and the Python suites against the installed wheel (never the checkout): by
# default the oldest and the newest release vkv supports (python/vkv/_torch_support.py).
#
#   scripts/test_torch_versions.sh WHEEL [RELEASE ...]     e.g. ... dist/vkv-0.1.0-cp311-*.whl 2.11 2.15
#
# Each environment, of the wheel's CPython, gets PyPI's torch==RELEASE.* (a CUDA build: ~3 GB
# with its nvidia-* libraries, which its import needs even without a GPU; the releases differ
# in which ones, so they cannot share them), numpy and the test packages, and is kept in
# VKV_TORCH_VENVS (default ~/.cache/vkv/torch-venvs) for the next run: the first run on a
# machine downloads, the next ones only install the wheel.
#
# The suites: tests/python, which exercises everything vkv does with torch (its tensors and
# views, DLPack, the stream, seq_lens, transformers, vAttention, the distributed wrappers),
# less what barely touches torch and costs minutes on 2 cores (the shared budget's processes,
# the fuzzer, the thread stress) and vLLM's suite (vLLM pins its own torch:
# scripts/test_engine_env.sh); not tests/lab or tests/benchmarks (programs over the same API).
# scripts/test.sh's pass with the pinned torch runs all of them. VKV_TORCH_VERSIONS_ALL=1 runs
# every suite here too. Exit 1 if any release fails.
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
suites=(tests/python)
ignore=(--ignore=tests/python/integrations/vllm_connector --ignore=tests/python/test_budget_stress.py
        --ignore=tests/python/test_shared_budget.py --ignore=tests/python/test_fuzz.py --ignore=tests/python/test_threads.py)
[ "${VKV_TORCH_VERSIONS_ALL:-0}" = 0 ] || suites=(tests/python tests/lab tests/benchmarks) ignore=()

has_torch() { "$venv/bin/python" -c "import sys, torch; sys.exit(not torch.__version__.startswith('$release.'))" 2>/dev/null; }
failed=()
for release in "${releases[@]}"; do
  start=$SECONDS venv="$venvs/torch-$release"
  if ! has_torch; then
    echo "== torch $release: installing"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$release.*" "${packages[@]}"
  fi
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
