#!/usr/bin/env bash
# On a GPU machine (~3 min, no network needed): the release wheel, built elsewhere, installed
# with --no-deps into a venv over the machine's own torch (--system-site-packages), then
# `python -m vkv` and the GPU tests run against that installed wheel, never the checkout.
#   scripts/gpu/wheel.sh OUT_DIR [WHEEL]
# WHEEL: default the newest .whl/vkv-*-cpXY-*.whl for this machine's python3 (build it with
# `scripts/build_wheel.sh --python python3.12 .whl/` on any Linux x86_64 machine with the CUDA
# toolkit, and carry .whl/). OUT_DIR/summary.txt gets one line per check and "wheel: PASS" or
# "wheel: FAIL" last; exit 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/wheel.sh OUT_DIR [WHEEL]}"
mkdir -p "$out"
tag="$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
wheel="${2:-$(ls -t .whl/vkv-*-"$tag"-*.whl 2>/dev/null | head -n1)}"
[ -f "$wheel" ] || { echo "wheel.sh: no vkv wheel for $tag in .whl/ (scripts/build_wheel.sh --python python3.X .whl/)" >&2; exit 2; }
summary="$out/summary.txt"
: > "$summary"
status=0
check() {  # check NAME OK: one summary line
  if [ "$2" = 0 ]; then echo "$1: ok" | tee -a "$summary"; else echo "$1: FAILED" | tee -a "$summary"; status=1; fi
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt" | sed 's/^/gpu: /' >> "$summary"
echo "wheel: $(basename "$wheel")" | tee -a "$summary"

venv=/tmp/vkv-wheel-venv
rm -rf "$venv"
python3 -m venv --system-site-packages "$venv"
# --system-site-packages reaches the base interpreter's packages only, not those of a venv
# python3 may be, nor its user site: a .pth puts every package folder python3 sees after the
# venv's own, so the machine's torch is found and the wheel's vkv comes first.
python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/machine-packages.pth"
start=$SECONDS
"$venv/bin/python" -m pip install -q --no-deps --no-index "$wheel" > "$out/pip.log" 2>&1
check "pip install --no-deps ($((SECONDS - start)) s)" $?
(cd /tmp && "$venv/bin/python" -c 'import sys, vkv; sys.exit(not vkv.__file__.startswith(sys.prefix))') 2>&1 | tee -a "$out/pip.log"
check "vkv imported from the venv, not the checkout" "${PIPESTATUS[0]}"

(cd /tmp && "$venv/bin/python" -W error::UserWarning -m vkv) > "$out/python_m_vkv.txt" 2>&1
rc=$?
cat "$out/python_m_vkv.txt"
grep -q "^backends: *host: yes; CUDA: yes" "$out/python_m_vkv.txt" && grep -q '^device="auto": *cuda:0' "$out/python_m_vkv.txt" &&
  grep -q "^CUDA stream from: *torch's C ABI" "$out/python_m_vkv.txt"
check "python -m vkv says CUDA (backend, device=\"auto\", the stream from torch's C ABI)" $(( rc || $? ))

# The GPU tests, the API's and the tensors' CUDA halves, and vLLM's KV buffer through torch's
# pluggable allocator (the extension's exported malloc/free), from the installed wheel.
(cd /tmp && PYTHONUNBUFFERED=1 timeout 900 "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs \
  --rootdir "$OLDPWD" -c "$OLDPWD/pyproject.toml" \
  "$OLDPWD/tests/python/test_gpu.py" "$OLDPWD/tests/python/test_build_info.py" "$OLDPWD/tests/python/test_api.py" \
  "$OLDPWD/tests/python/test_tensors.py" "$OLDPWD/tests/python/test_zero_page.py" \
  "$OLDPWD/tests/python/test_view_copies.py" \
  "$OLDPWD/tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py") > "$out/pytest.log" 2>&1
rc=$?
tail -n 15 "$out/pytest.log"
line="$(grep -E '^=* ?[0-9]+ (passed|failed)' "$out/pytest.log" | tail -n1)"
check "GPU tests from the wheel: ${line:-no summary line}" $(( rc != 0 ))
grep -q "skipped" <<<"$line" && grep -E "SKIPPED.*(no CUDA|needs a CUDA)" "$out/pytest.log" | head -3 | tee -a "$summary"
[ "$status" = 0 ] && echo "wheel: PASS" | tee -a "$summary" || echo "wheel: FAIL" | tee -a "$summary"
exit "$status"
