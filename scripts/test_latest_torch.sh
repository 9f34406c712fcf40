#!/usr/bin/env bash
# Builds the Python package against the newest torch vkv supports (2.14.x: its headers need
# C++20, so the bindings build as C++20) and runs `python -m vkv` and the Python suites with
# it. It lives in a virtual environment of its own, without the system's packages (the system
# or .venv Python keeps the pinned torch 2.13), kept outside the checkout so that a fresh
# clone on the same machine reuses it (torch and its CUDA libraries are ~5.5 GB, minutes to
# install), and builds in build/python-torch-latest. scripts/test.sh runs it last.
#   VKV_LATEST_TORCH='torch>=2.14,<2.15' (the default) names the torch to test;
#   VKV_LATEST_TORCH_VENV (default ~/.cache/vkv/venv-torch-latest) the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
spec="${VKV_LATEST_TORCH:-torch>=2.14,<2.15}"
venv="${VKV_LATEST_TORCH_VENV:-$HOME/.cache/vkv/venv-torch-latest}"

start=$SECONDS
[ -x "$venv/bin/python" ] || { mkdir -p "$(dirname "$venv")" && "$vkv_base_python" -m venv "$venv"; }
# A CUDA build of torch on Linux (its import needs the nvidia-* libraries, ~5 GB in all; a
# no-deps install does not import), then what vkv and its tests need. --upgrade: the newest
# release that `spec` admits.
echo "== installing $spec into $venv"
"$venv/bin/python" -m pip install -q --upgrade "$spec" numpy scikit-build-core pytest hypothesis "transformers==5.17.0"
echo "== $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)') installed in $((SECONDS - start)) s"

VKV_PYTHON="$venv/bin/python" VKV_INSTALL_LOG="$vkv_root/build/pip-install-torch-latest.log" \
  vkv_install --config-settings=build-dir=build/python-torch-latest
(cd /tmp && "$venv/bin/python" -m vkv)
# Every suite of the library and its integrations; the serving demo's and the benchmark
# harnesses' suites (pure Python over the same bindings, the slowest: minutes on 2 cores)
# run in scripts/test.sh's pass with the pinned torch. VKV_LATEST_TORCH_ALL=1 runs them too.
# vLLM's tests also run there: this venv has none of the packages vLLM's scheduler imports;
# SGLang's run in scripts/test_sglang.sh, which installs SGLang into this venv.
ignore=(--ignore=tests/python/demo/test_demo.py --ignore=tests/python/demo/test_demo_cuda_graphs.py
        --ignore=tests/python/benchmarks/test_attention_bench.py
        --ignore=tests/python/integrations/vllm_connector --ignore=tests/python/integrations/sglang_engine)
[ "${VKV_LATEST_TORCH_ALL:-0}" = 0 ] || ignore=()
"$venv/bin/python" -m pytest tests/python -q -p no:cacheprovider "${ignore[@]}"
echo "== torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): passed in $((SECONDS - start)) s"
