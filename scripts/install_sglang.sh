#!/usr/bin/env bash
# Installs SGLang 0.5.23 for the CPU tests of vkv.integrations.sglang into its own virtual
# environment, .venv-sglang in the checkout (SGLang pins torch 2.14.1 and a torchvision built
# for it; vkv's main environment keeps torch 2.13's CPU build): torch 2.14.1 (its CUDA build,
# importable without a GPU; ~5.5 GB with its nvidia-* libraries), then the SGLang wheel with
# --no-deps (sglang-kernel, FlashInfer and torch_memory_saver are never pulled in) plus the
# pure-Python packages that SGLang's launcher, scheduler and detokenizer import, then the
# test tools and what vkv builds with. Idempotent: does nothing when SGLang already imports.
# Then install vkv into it: a wheel with --no-deps (scripts/test_sglang.sh WHEEL does both).
# VKV_TEST_SGLANG_PIP_CONFIG_FILE: pip's configuration for this environment alone (CI points the
# others at PyPI; SGLang's torch 2.14.1 comes from the machine's own index).
# Usage: scripts/install_sglang.sh      (VKV_TEST_SGLANG_VENV=DIR for another place,
#                                        VKV_TEST_SGLANG_WHEEL=/path/to/sglang-0.5.23-*.whl to skip its download)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VKV_TEST_SGLANG_VENV:-$root/.venv-sglang}"
[ -z "${VKV_TEST_SGLANG_PIP_CONFIG_FILE:-}" ] || export PIP_CONFIG_FILE="$VKV_TEST_SGLANG_PIP_CONFIG_FILE"
python="$venv/bin/python"
probe='import sglang, sglang.srt.managers.scheduler, sglang.srt.entrypoints.engine, sglang.srt.plugins.hook_registry, pytest, hypothesis; assert sglang.__version__ == "0.5.23", sglang.__version__'

if [ -x "$python" ] && "$python" -c "$probe" >/dev/null 2>&1; then
  echo "install_sglang.sh: SGLang 0.5.23 already importable by $python"
  exit 0
fi
start=$SECONDS
if [ ! -x "$python" ]; then
  "${VKV_BASE_PYTHON:-python3.11}" -m venv "$venv"  # the SGLang wheel is for CPython 3.11
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "install_sglang.sh: SGLang 0.5.23 is a CPython 3.11 wheel; $python is $("$python" --version)" >&2
  exit 1
fi
"$python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
pip=("$python" -m pip install -q --no-deps)
"${pip[@]}" "${VKV_TEST_SGLANG_WHEEL:-sglang==0.5.23}"
# Found by starting sglang.Engine on a CPU (SGLANG_USE_CPU_ENGINE=1, tests/python/sglang_testing.py),
# versions where SGLang 0.5.23 pins one. No CUDA packages besides torch's own.
"${pip[@]}" numpy orjson psutil pybase64 requests urllib3 idna certifi packaging pillow starlette anyio \
  sniffio msgspec pydantic pydantic_core annotated-types typing-inspection typing_extensions pyzmq tqdm \
  ipython traitlets pygments aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist \
  huggingface_hub hf-xet filelock fsspec pyyaml setproctitle "apache-tvm-ffi==0.1.11" "transformers==5.19.0" \
  tokenizers safetensors regex typer click shellingham rich httpx httpcore h11 httpx2 httpcore2 truststore \
  dill sentencepiece compressed_tensors loguru gguf openai partial_json_parser einops uvicorn fastapi \
  annotated_doc opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions importlib_metadata \
  zipp deprecated wrapt uvloop "xgrammar==0.2.7" jinja2 markupsafe
# vkv's tests.
"$python" -m pip install -q pytest hypothesis

if ! err=$("$python" -c "$probe" 2>&1); then
  echo "install_sglang.sh: SGLang 0.5.23 still does not import: $(echo "$err" | tail -1)" >&2
  exit 1
fi
echo "install_sglang.sh: SGLang 0.5.23 (torch 2.14.1, no CUDA kernels) importable by $python, in $((SECONDS - start)) s"
