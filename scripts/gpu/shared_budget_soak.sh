#!/usr/bin/env bash
# On the GPU host: the shared budget's soak (benchmarks/soak/budget_soak.py), 16 member
# processes on the CUDA backend, then 16 on the host backend, each run long enough for
# >= 30 minutes of member-time (16 x 135 s), SIGKILLs and resizes included: 0 crashes,
# 0 invariant breaks, 0 bytes changed expected. About 5 minutes plus the build.
#   [VKV_COMMIT=<sha>] scripts/gpu/shared_budget_soak.sh OUT_DIR [SECONDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/shared_budget_soak.sh OUT_DIR [SECONDS]}"
seconds="${2:-135}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
source scripts/gpu/common.sh
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
export VKV_COMMIT="${VKV_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"  # pass it where the copy has no .git
install_vkv
repo="$(pwd)"
step budget_soak_cuda $((seconds + 120)) env PYTHONUNBUFFERED=1 python3 -m benchmarks.soak.budget_soak \
  --device cuda --members 16 --seconds "$seconds" --out "$out"
step budget_soak_cpu $((seconds + 120)) env PYTHONUNBUFFERED=1 python3 -m benchmarks.soak.budget_soak \
  --device cpu --members 16 --seconds "$seconds" --out "$out"
# The members' own files stay only where something failed; the summaries always.
[ $status -ne 0 ] || rm -rf "$out"/budget_soak_cuda "$out"/budget_soak_cpu
exit $status
