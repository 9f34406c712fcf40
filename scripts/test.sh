#!/usr/bin/env bash
# Builds vkv and runs every test: the C++ suites, the install/find_package check, and the
# Python suites against the installed wheel (CUDA tests skip without a GPU): the wheel is
# built once (scripts/build_wheel.sh, into <build-dir>/wheels) and installed into the Python
# scripts/python_env.sh picks, over its torch; the suites import it, never the checkout.
# With VKV_TEST_TORCH_VERSIONS=1 (CI sets it), the same wheel is then tested with the oldest
# and the newest torch vkv supports (scripts/test_torch_versions.sh: a ~3 GB download the
# first time, so not by default).
# VKV_TEST_TRANSFORMERS_VERSIONS=1 (CI sets it too) tests the oldest and the newest
# supported transformers 5.x as well (scripts/test_transformers_versions.sh).
# Usage: scripts/test.sh [--venv] [build-dir]
#
# Each step's whole output goes to a log under <build-dir>/test-logs/; the terminal gets one
# line per step and, at the end, one line per suite:
#   ctest: 387 passed, 0 failed, 196 skipped in 245 s (build/test-logs/ctest.log)
# A failing suite shows its failing lines and the end of its log, the other suites still run,
# and the script exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
build="${vkv_args[0]:-build}"
logs="$build/test-logs"
mkdir -p "$logs"
summary=() status=0

# step NAME COMMAND...: a step the suites need (build, install); its failure ends the script.
step() {
  local name="$1" log="$logs/$1.log" start=$SECONDS
  shift
  echo "== $name (log: $log)"
  if ! "$@" >"$log" 2>&1; then
    echo "== $name failed; the end of $log:" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
  echo "   done in $((SECONDS - start)) s"
}

# "N passed, N failed[, N skipped]" from a ctest log (its "tests passed, N tests failed out
# of M" line) or a pytest log (the sum of its closing lines: the optional suites run pytest
# more than once).
ctest_counts() {
  local skipped
  skipped="$(grep -cE '^[[:space:]]+[0-9]+ - .*\(Skipped\)$' "$1" || true)"
  sed -n 's/.*tests passed, \([0-9]*\) tests\{0,1\} failed out of \([0-9]*\).*/\1 \2/p' "$1" | tail -n1 |
    awk -v skipped="$skipped" '{printf "%d passed, %d failed, %d skipped", $2 - $1 - skipped, $1, skipped}'
}
pytest_counts() {
  grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed|warnings?)\b.* in [0-9.]+s' "$1" |
    awk '{for (i = 1; i < NF; i++) {n = $(i + 1); sub(/[,=]+$/, "", n)
            if (n == "passed") p += $i; else if (n == "failed" || n ~ /^errors?$/) f += $i; else if (n == "skipped") s += $i}
          found = 1}
         END {if (found) printf "%d passed, %d failed, %d skipped", p, f, s}'
}

# suite NAME ctest|pytest COMMAND...: a test suite; its summary line is kept for the end.
suite() {
  local name="$1" kind="$2" log="$logs/$1.log" start=$SECONDS rc=0 counts
  shift 2
  echo "== $name (log: $log)"
  "$@" >"$log" 2>&1 || rc=$?
  counts="$("${kind}_counts" "$log" || true)"
  [ -n "$counts" ] || counts="0 passed, 1 failed (no summary line in the log)"
  if [ "$rc" != 0 ] || [[ "$counts" != *" 0 failed"* ]]; then
    status=1
    [ "$rc" != 0 ] || rc="0, but failures"
    echo "== $name failed (exit $rc); its failing lines:" >&2
    # (not ctest's lines for tests that start, pass or skip, whose names may say "Failed")
    grep -E 'FAILED|Failed|\[  FAILED|Failure|ERROR|SEGFAULT|Timeout|Exception|Error:' "$log" |
      grep -vE '^ +Start +[0-9]+: |(Passed|\*\*\*Skipped) +[0-9.]+ sec$|\(Skipped\)$' | head -n 60 >&2 || true
    echo "== the end of $log:" >&2
    tail -n 20 "$log" >&2
    [ -z "$(tail -c 1 "$log")" ] || echo >&2  # a log cut mid-line
  fi
  summary+=("$name: $counts in $((SECONDS - start)) s ($log)")
  echo "   $counts in $((SECONDS - start)) s"
}

bash scripts/bootstrap.sh
step configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON
step build cmake --build "$build"
suite ctest ctest ctest --test-dir "$build" --output-on-failure -j"$(nproc)"

# The wheel (host-only where there is no CUDA toolkit), installed without its dependencies:
# the torch already installed stays.
step wheel env VKV_WITH_CUDA="${VKV_WITH_CUDA:-AUTO}" bash scripts/build_wheel.sh --python "$VKV_PYTHON" "$build/wheels"
wheel="$(tail -n 1 "$logs/wheel.log")"
step python-install "$VKV_PYTHON" -m pip install --no-deps --force-reinstall "$wheel"
step python-info bash -c 'cd /tmp && "$VKV_PYTHON" -m vkv'
# vLLM 0.33 without its CUDA dependencies, so the vLLM tests run (never skip) here.
step vllm-install env PYTHON="$VKV_PYTHON" bash scripts/install_vllm.sh
suite pytest pytest "$VKV_PYTHON" -m pytest tests/python tests/lab tests/benchmarks -q -p no:cacheprovider

# CI: the oldest and the newest transformers 5.x, each in a throwaway venv over this torch.
[ "${VKV_TEST_TRANSFORMERS_VERSIONS:-0}" = 0 ] ||
  suite transformers-versions pytest env PYTHON="$VKV_PYTHON" bash scripts/test_transformers_versions.sh
# CI: the same wheel with the oldest and the newest supported torch, each in a venv of its own.
[ "${VKV_TEST_TORCH_VERSIONS:-0}" = 0 ] || suite torch-versions pytest bash scripts/test_torch_versions.sh "$wheel"
# CI: the same wheel inside SGLang 0.5.23's own engine, in SGLang's environment (its torch
# 2.14.1), and a vLLM and an SGLang engine on one budget (scripts/test_sglang.sh).
[ "${VKV_TEST_SGLANG:-0}" = 0 ] || suite sglang pytest bash scripts/test_sglang.sh "$wheel"

echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$status"
