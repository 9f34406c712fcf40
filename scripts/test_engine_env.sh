#!/usr/bin/env bash
# Installs the vkv wheel with --no-deps into a serving engine's own environment (its pinned
# torch untouched) and runs `python -m vkv` and vkv's integration tests there, against the
# installed wheel, never the checkout.
#
#   scripts/test_engine_env.sh vllm WHEEL                 vLLM 0.33 beside its torch 2.14.0
#   scripts/test_engine_env.sh VENV WHEEL [PYTEST_ARGS]   any environment, e.g. SGLang's:
#     scripts/test_engine_env.sh ~/sglang-venv dist/vkv-*.whl tests/python/integrations
#
# `vllm` makes (once, kept in VKV_ENGINE_VENVS, default ~/.cache/vkv/engine-venvs) an
# environment of the wheel's CPython with torch==2.14.0, vLLM 0.33's pin, from PyPI (~3 GB with
# its nvidia-* libraries), and vLLM itself through scripts/install_vllm.sh (the wheel without
# its CUDA dependencies, plus what its scheduler imports); then runs vLLM's tests and the API's. With a VENV, PYTEST_ARGS default to tests/python/integrations and test_api.py.
# Prints "engine env: N passed, N failed" last.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -ge 2 ] && [ -f "$2" ] || { echo "usage: scripts/test_engine_env.sh vllm|VENV WHEEL [PYTEST_ARGS]" >&2; exit 2; }
target="$1" wheel="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
shift 2
tests=("$@")
start=$SECONDS

if [ "$target" = vllm ]; then
  python="$(basename "$wheel" | sed -n 's/.*-cp\([0-9]\)\([0-9]*\)-cp[0-9]*-.*/python\1.\2/p')"
  venv="${VKV_ENGINE_VENVS:-$HOME/.cache/vkv/engine-venvs}/vllm-0.33"
  if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.14.0')" 2>/dev/null; then
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    echo "== vLLM's environment: torch 2.14.0"
    "${pip[@]}" torch==2.14.0
    "${pip[@]}" numpy pytest hypothesis
    PYTHON="$venv/bin/python" bash "$root/scripts/install_vllm.sh"
  fi
  [ ${#tests[@]} -gt 0 ] || tests=(tests/python/integrations/vllm_connector tests/python/test_api.py)
else
  venv="$target"
  [ -x "$venv/bin/python" ] || { echo "test_engine_env: $venv/bin/python does not exist" >&2; exit 2; }
  [ ${#tests[@]} -gt 0 ] || tests=(tests/python/integrations tests/python/test_api.py)
  "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest hypothesis
fi

torch_before="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
torch_after="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
[ "$torch_before" = "$torch_after" ] || { echo "test_engine_env: installing vkv changed torch $torch_before -> $torch_after" >&2; exit 1; }
echo "== $venv: torch $torch_after, ready in $((SECONDS - start)) s; python -m vkv:"
(cd /tmp && "$venv/bin/python" -m vkv) | sed 's/^/   /'
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
rc=0
(cd "$root" && "$venv/bin/python" -m pytest "${tests[@]}" -q -p no:cacheprovider) 2>&1 | tee "$log" || rc=$?
counts="$(grep -E '^=* ?[0-9]+ (passed|failed)' "$log" | tail -n1 |
  awk '{p = f = 0; for (i = 1; i < NF; i++) {if ($(i+1) ~ /^passed/) p = $i; if ($(i+1) ~ /^failed/) f = $i}
        print p " passed, " f " failed"}')"
echo "engine env: ${counts:-0 passed, 1 failed} (torch $torch_after, $((SECONDS - start)) s)"
exit "$rc"
