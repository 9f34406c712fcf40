#!/usr/bin/env bash
# On a GPU machine: what handing 256 MiB, 1 GiB and 4 GiB from an idle member of a shared
# budget to an asker costs, split into waiting for readers, unmap, release and count-back,
# with 2 MiB pages and with 128 MiB large pages (benchmarks/budget_handoff/reclaim_cost.py), then the
# release path's C++ tests on the CUDA backend (an unmap before the work that reads the
# pages has completed would end the CUDA context; VKV_SKIP_CPP=1 skips them).
#   scripts/gpu/reclaim_cost.sh OUT_DIR [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/reclaim_cost.sh OUT_DIR [ROUNDS]}"
rounds="${2:-30}"
mkdir -p "$out"
src="$PWD"
source scripts/gpu/common.sh
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
commit="$(tree_commit)"
echo "$commit" > "$out/commit.txt"
install_vkv || exit 1
VKV_GIT_COMMIT="$commit" step reclaim_cost 540 python3 -m benchmarks.budget_handoff.reclaim_cost --device cuda \
  --rounds "$rounds" --out "$out"
[ "${VKV_SKIP_CPP:-0}" = 1 ] && exit $status  # the tests below need a C++ build too (minutes)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON >/dev/null \
  && cmake --build build-gpu --target vkv_tests 2>&1 | tail -2
step cpp_reclaim 300 "$src/build-gpu/tests/cpp/vkv_tests" \
  --gtest_filter='*Reclaim*:*DeferredFill*:*LargePages*:*Elastic*:*FaultInjection*'
exit $status
