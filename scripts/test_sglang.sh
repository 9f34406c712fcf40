#!/usr/bin/env bash
# The tests of vkv.integrations.sglang against SGLang 0.5.23 itself (its engine on the CPU):
# installs SGLang (scripts/install_sglang.sh) into the environment of scripts/test_latest_torch.sh
# (torch 2.14.1, which SGLang pins: its ~5.5 GB are installed once for both), builds vkv into
# it, and runs tests/python/integrations/sglang_engine; then, with vkv's own Python (which has
# vLLM: scripts/install_vllm.sh), the test of a vLLM and an SGLang engine sharing one budget
# (test_sglang_with_vllm.py, VKV_SGLANG_PYTHON naming this environment's Python). scripts/test.sh runs it with
# VKV_TEST_SGLANG=1 (CI does). VKV_SGLANG_VENV=DIR picks another environment (.venv-sglang:
# the one install_sglang.sh makes by default).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
venv="${VKV_SGLANG_VENV:-${VKV_LATEST_TORCH_VENV:-$HOME/.cache/vkv/venv-torch-latest}}"
start=$SECONDS
VKV_SGLANG_VENV="$venv" bash scripts/install_sglang.sh
VKV_PYTHON="$venv/bin/python" VKV_INSTALL_LOG="$vkv_root/build/pip-install-sglang.log" \
  vkv_install --config-settings=build-dir=build/python-sglang
echo "== SGLang $("$venv/bin/python" -c 'import sglang; print(sglang.__version__)') and vkv in $venv after $((SECONDS - start)) s"
status=0
"$venv/bin/python" -m pytest tests/python/integrations/sglang_engine -q -p no:cacheprovider || status=1
VKV_SGLANG_PYTHON="$venv/bin/python" "$VKV_PYTHON" -m pytest \
  tests/python/integrations/sglang_engine/test_sglang_with_vllm.py -q -p no:cacheprovider || status=1
exit $status
