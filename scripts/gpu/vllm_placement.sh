#!/usr/bin/env bash
# vLLM's KV buffer on a GPU in vkv memory, ≤ 3 minutes after the build: the scratch page's
# C++ CUDA tests, tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py (no vLLM: what
# allocate_kv_cache() does inside get_mem_pool_context(), then K/V through BLNHC views), and
# both under compute-sanitizer memcheck when it is installed. Results: $OUT/*.log.
#   OUT=DIR scripts/gpu/vllm_placement.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
out="${OUT:?usage: OUT=DIR scripts/gpu/vllm_placement.sh}"
src="$(pwd)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$out/gpu.txt"
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
install_vkv > "$out/pip.log" 2>&1 &  # once per machine and tree; says why where it fails
pip_pid=$!
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON -DVKV_BUILD_BENCHMARKS=OFF \
  -DVKV_BUILD_EXAMPLES=OFF >/dev/null && cmake --build build-gpu --target vkv_tests -j12 2>&1 | tail -1
wait $pip_pid || { cat "$out/pip.log"; exit 1; }
status=0
filter='*Scratch*:*ZeroPage*cuda*'
timeout 60 build-gpu/tests/cpp/vkv_tests --gtest_filter="$filter" 2>&1 | tee "$out/cpp.log" | tail -4
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
(cd /tmp && timeout 180 python3 -m pytest "$src/tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py" -q -p no:cacheprovider -rsx \
  2>&1) | tee "$out/pytest.log" | tail -12
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if command -v compute-sanitizer >/dev/null; then
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 build-gpu/tests/cpp/vkv_tests \
    --gtest_filter='*ScratchPageTest*cuda*' > "$out/memcheck_cpp.log" 2>&1
  echo "memcheck (C++ scratch, CUDA) exit $?"; tail -3 "$out/memcheck_cpp.log"
  (cd /tmp && timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest \
    "$src/tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py" -q -p no:cacheprovider -k "vllm_buffer or refuses or any_size") \
    > "$out/memcheck_py.log" 2>&1
  echo "memcheck (pytest GPU placement) exit $?"; tail -3 "$out/memcheck_py.log"
else
  echo "compute-sanitizer not installed: memcheck skipped"
fi
exit $status
