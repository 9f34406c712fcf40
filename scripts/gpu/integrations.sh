#!/usr/bin/env bash
# On a GPU machine, ~4 minutes: the integrations on CUDA: the CUDA variants of the slot tests,
# the find_package consumer and no-CUDA-headers ctests, the vattention, transformers and docs
# pytest files, and the transformers benchmark. Logs and the benchmark's JSON go to $OUT.
#   OUT=DIR scripts/gpu/integrations.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
out="${OUT:?usage: OUT=DIR scripts/gpu/integrations.sh}"
src="$(pwd)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
(python3 -m pip install -q --no-build-isolation --no-deps . > "$out/pip.log" 2>&1 \
  || { tail -30 "$out/pip.log"; echo "integrations.sh: pip install failed" >&2; exit 1; }) &
pip_pid=$!
(cmake -S . -B build-gpu -G Ninja -DVKV_BUILD_BENCHMARKS=OFF -DVKV_BUILD_EXAMPLES=OFF >/dev/null \
  && cmake --build build-gpu --target vkv_tests -j8 2>&1 | tail -1 \
  && build-gpu/tests/cpp/vkv_tests --gtest_filter='*SlotCalls*' 2>&1 | tail -4 \
  && timeout 150 ctest --test-dir build-gpu -R "install_and_find_package|configure_without_cuda_headers" --output-on-failure 2>&1 | tail -4) > "$out/cpp.log" 2>&1 &
cpp_pid=$!
wait $pip_pid || exit 1
(cd /tmp && timeout 200 python3 -m pytest "$src/tests/python/test_vattention.py" "$src/tests/python/integrations/test_transformers_cache.py" \
  "$src/tests/python/test_slot_calls.py" "$src/tests/python/test_docs.py" -q -p no:cacheprovider -rsx --durations=8 2>&1) | tee "$out/pytest.log" | tail -25
(cd /tmp && PYTHONPATH="$src" timeout 170 python3 -m benchmarks.transformers_generate.transformers_bench --device cuda --out "$out" 2>&1) | tee "$out/bench.log" | tail -16
wait $cpp_pid
cat "$out/cpp.log"
