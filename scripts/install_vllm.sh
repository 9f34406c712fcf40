#!/usr/bin/env bash
# Installs vLLM 0.33.0 for the CPU tests of vkv.integrations.vllm, into whatever python3 is
# first on PATH (CI's, or an activated venv's), without its CUDA dependencies: the wheel
# with --no-deps (its pinned torch 2.14 and FlashInfer are never pulled in; the torch
# already installed stays) plus the pure-Python packages that vLLM's Scheduler,
# KVCacheManager, configs and KV-connector base import. Idempotent: does nothing when
# they already import.
# Usage: scripts/install_vllm.sh        (VKV_VLLM_WHEEL=/path/to/vllm-0.33.0-*.whl to skip the download)
set -euo pipefail
python="${PYTHON:-python3}"
probe='import vllm, vllm.config, vllm.v1.core.sched.scheduler, vllm.v1.core.kv_cache_utils, vllm.v1.worker.utils, vllm.distributed.kv_transfer.kv_connector.v1.base; assert vllm.__version__ == "0.33.0", vllm.__version__'

if "$python" -c "$probe" >/dev/null 2>&1; then
  echo "install_vllm.sh: vLLM 0.33.0 already importable by $("$python" -c 'import sys; print(sys.executable)')"
  exit 0
fi

pip=("$python" -m pip install -q --no-deps)
"${pip[@]}" "${VKV_VLLM_WHEEL:-vllm==0.33.0}"
# What the scheduler side imports, found by importing it on a CPU-only torch (versions
# within vllm 0.33.0's Requires-Dist where it pins one). No torch, no CUDA packages.
"${pip[@]}" cbor2 psutil pyzmq msgspec cachetools pybase64 uvloop einops pillow \
  "aiohttp>=3.14.4" "multidict>=6.9.1" yarl propcache aiohappyeyeballs aiosignal frozenlist \
  "openai>=2.25.0" openai-harmony httpx2 "fastapi<0.137.0,>=0.133.0" "starlette>=1.0.1" \
  "prometheus_client>=0.18.0" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11" "llguidance<1.8.0,>=1.7.0" \
  partial-json-parser "opentelemetry-api>=1.27.0" "requests>=2.33.0" urllib3 charset-normalizer idna certifi \
  attrs sniffio cloudpickle py-cpuinfo
# What a fresh environment (an engine's own, scripts/test_engine_env.sh) lacks besides: pure
# Python, none of it pulls torch, so with their own dependencies; transformers within vLLM
# 0.33.0's range, only where none is installed (the transformers tests pick their own).
"$python" -m pip install -q pydantic regex
"$python" -c "import transformers" 2>/dev/null || "$python" -m pip install -q "transformers>=5.16.1,<5.21.0"

if ! err=$("$python" -c "$probe" 2>&1); then
  echo "install_vllm.sh: vLLM 0.33.0 still does not import: $(echo "$err" | tail -1)" >&2
  exit 1
fi
echo "install_vllm.sh: vLLM 0.33.0 (no CUDA dependencies) importable by $("$python" -c 'import sys; print(sys.executable)')"
