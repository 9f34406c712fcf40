#!/usr/bin/env bash
# The tests of vkv.integrations.sglang against SGLang 0.5.23 itself (its engine on the CPU),
# with ONE vkv wheel installed unchanged (--no-deps) into SGLang's own environment
# (scripts/install_sglang.sh: torch 2.14.1, which SGLang pins; kept in VKV_TEST_SGLANG_VENV, default
# ~/.cache/vkv/engine-venvs/sglang-0.5.23, for the next run): tests/python/integrations/sglang_engine
# there. scripts/test.sh runs it with VKV_TEST_SGLANG=1 (CI does). Then, with vkv's own Python
# (VKV_PYTHON: scripts/test.sh installs the same wheel there, and vLLM with
# scripts/install_vllm.sh), a vLLM and an SGLang engine sharing one budget
# (test_sglang_with_vllm.py, VKV_TEST_SGLANG_PYTHON naming SGLang's Python; ~2-3 minutes): skipped,
# in one line, where VKV_PYTHON cannot import vkv and vLLM; VKV_TEST_SGLANG_WITH_VLLM=0 skips it.
#   scripts/test_sglang.sh WHEEL
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
[ ${#vkv_args[@]} -ge 1 ] && [ -f "${vkv_args[0]}" ] || { echo "usage: scripts/test_sglang.sh WHEEL" >&2; exit 2; }
wheel="${vkv_args[0]}"
venv="${VKV_TEST_SGLANG_VENV:-$HOME/.cache/vkv/engine-venvs/sglang-0.5.23}"
start=$SECONDS
VKV_TEST_SGLANG_VENV="$venv" bash scripts/install_sglang.sh
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
echo "== SGLang $("$venv/bin/python" -c 'import sglang; print(sglang.__version__)') and $(basename "$wheel") in $venv after $((SECONDS - start)) s"
status=0
"$venv/bin/python" -m pytest tests/python/integrations/sglang_engine -q -p no:cacheprovider || status=1
with_vllm=tests/python/integrations/sglang_engine/test_sglang_with_vllm.py
if [ "${VKV_TEST_SGLANG_WITH_VLLM:-1}" = 0 ]; then
  echo "== $with_vllm skipped (VKV_TEST_SGLANG_WITH_VLLM=0)"
elif ! "$VKV_PYTHON" -c 'import pytest, vkv, vllm' >/dev/null 2>&1; then
  echo "== $with_vllm skipped: $VKV_PYTHON cannot import vkv and vLLM (scripts/install_vllm.sh)"
else
  VKV_TEST_SGLANG_PYTHON="$venv/bin/python" "$VKV_PYTHON" -m pytest "$with_vllm" -q -p no:cacheprovider || status=1
fi
exit $status
