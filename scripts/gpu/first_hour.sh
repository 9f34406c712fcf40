#!/usr/bin/env bash
# On a GPU machine (a few minutes): the newcomer's route with a .venv over the machine's own
# torch (VKV_VENV=1: created with --system-site-packages since the system Python has torch),
# then what `python -m vkv` reports there and the build-info tests. Logs go to OUT_DIR.
#   scripts/gpu/first_hour.sh OUT_DIR
# Expect in OUT_DIR/python_m_vkv.txt: "CUDA: yes (built against cuda.h ...)", a CUDA driver
# version, "GPUs: cuda:0 NVIDIA ...", "vkv sees a GPU: yes", 'device="auto": cuda:0'.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/first_hour.sh OUT_DIR}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
status=0
export VKV_VENV=1
start=$SECONDS
bash scripts/bootstrap.sh --demo 2>&1 | tee "$out/bootstrap.log" || status=1
echo "=== bootstrap: $((SECONDS - start)) s" | tee -a "$out/times.txt"
source scripts/python_env.sh
start=$SECONDS
vkv_install 2>&1 | tee "$out/build.log" | tail -8 || status=1
echo "=== build and install: $((SECONDS - start)) s" | tee -a "$out/times.txt"
(cd /tmp && "$VKV_PYTHON" -W error::UserWarning -m vkv) 2>&1 | tee "$out/python_m_vkv.txt" || status=1
(cd /tmp && "$VKV_PYTHON" -m pytest "$OLDPWD/tests/python/test_build_info.py" -q -p no:cacheprovider -rs 2>&1) |
  tee "$out/pytest_build_info.log" | tail -5
grep -qE "[0-9]+ passed" "$out/pytest_build_info.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/pytest_build_info.log" ||
  status=1
exit $status
