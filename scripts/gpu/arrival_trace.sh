#!/usr/bin/env bash
# On a GPU machine, within ~9 minutes: the arrival trace (free_reqid/alloc_reqid p50,
# step() p99, the burst of 32 prompts mapped by one step(), with and without large pages)
# for this tree and, where git can give it, for BASE beside it on the same GPU; then the
# CUDA C++ suites and compute-sanitizer memcheck over the suites that order zero-fills,
# copies and unmaps (deferred fill, swap, sharing, fault injection), and the Python tests
# of zero-fill on torch's streams, zero-page reads and sharing. vAttention runs too
# when a checkout sits at ../.vattention (arrivals_bench --vattention). Everything lands
# in OUT_DIR/results.tar.gz (logs, JSON, plots) and OUT_DIR/summary.txt.
#   scripts/gpu/arrival_trace.sh OUT_DIR [BASE]     # BASE: a commit, default 94b8553
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/arrival_trace.sh OUT_DIR [BASE]}"
base="${2:-94b8553}"
work="$out/results"
mkdir -p "$work/logs" "$work/new" "$work/base"
deadline=$((SECONDS + ${VKV_GPU_SECONDS:-520}))
# Seconds a step may take: at most $1, and what is left before the deadline (at least 1).
budget() { local left=$((deadline - SECONDS)); left=$((left < $1 ? left : $1)); echo $((left > 1 ? left : 1)); }
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/gpu.txt"

# Three builds at once: the C++ suites, this tree's package, the baseline's package.
(cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVKV_ASSERTS=ON -DVKV_BUILD_EXAMPLES=OFF \
  >/dev/null && cmake --build build-gpu -j8) > "$work/logs/build_cpp.log" 2>&1 &
cpp=$!
python3 -m pip install -q --no-build-isolation --no-deps . > "$work/logs/build_python.log" 2>&1 &
python=$!
baseline=""
if git rev-parse --verify -q "$base^{commit}" >/dev/null 2>&1; then
  rm -rf /tmp/vkv-base-src /tmp/vkv-base && mkdir -p /tmp/vkv-base-src
  git archive "$base" | tar -x -C /tmp/vkv-base-src
  python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/vkv-base /tmp/vkv-base-src \
    > "$work/logs/build_base.log" 2>&1 &
  baseline=$!
else
  echo "no git history for $base here: the baseline is not run" | tee "$work/logs/build_base.log"
fi
wait $python || { echo "python build failed"; status=1; }
[ -z "$baseline" ] || wait $baseline || { echo "baseline build failed"; baseline=""; }
echo "builds done at ${SECONDS}s"

# Timings first, once every build is done: the trace's times are host-side.
wait $cpp || { echo "C++ build failed"; status=1; }
PYTHONUNBUFFERED=1 timeout "$(budget 150)" python3 -m benchmarks.step_latency.arrivals_bench --out "$work/new" \
  > "$work/logs/arrivals_new.log" 2>&1 || status=1
grep -E "burst|prompt mapping" "$work/logs/arrivals_new.log"
if [ -n "$baseline" ]; then
  PYTHONPATH=/tmp/vkv-base PYTHONUNBUFFERED=1 timeout "$(budget 100)" python3 -m benchmarks.step_latency.arrivals_bench --only arrivals \
    --out "$work/base" > "$work/logs/arrivals_base.log" 2>&1 || echo "baseline run failed"
  grep -E "burst|vkv_module" "$work/logs/arrivals_base.log"
fi

# The CUDA C++ suites (fault injection every 7th call, as scripts/gpu/fault_safety.sh).
VKV_FAULT_EVERY=7 timeout "$(budget 150)" \
  ctest --test-dir build-gpu --output-on-failure -j6 -R "cuda|Cuda" > "$work/logs/ctest_cuda.log" 2>&1
grep -E "tests passed|Failed|\*\*\*" "$work/logs/ctest_cuda.log" | tail -6
grep -q "100% tests passed" "$work/logs/ctest_cuda.log" || status=1
# The Python tests of zero-fill on torch's streams and of zero-page reads, on the GPU.
(cd /tmp && timeout "$(budget 90)" python3 -m pytest "$OLDPWD/tests/python/test_gpu.py::test_zero_fill_follows_the_current_stream" \
  "$OLDPWD/tests/python/test_zero_page.py" "$OLDPWD/tests/python/test_sharing.py" -q -p no:cacheprovider 2>&1) \
  > "$work/logs/pytest_gpu.log"
tail -1 "$work/logs/pytest_gpu.log"
grep -qE "[0-9]+ passed" "$work/logs/pytest_gpu.log" && ! grep -qE "[0-9]+ (failed|error)" "$work/logs/pytest_gpu.log" || status=1
VKV_FAULT_EVERY=11 timeout "$(budget 600)" compute-sanitizer --tool memcheck --error-exitcode 3 \
  build-gpu/tests/cpp/vkv_tests --gtest_filter='*DeferredFill*cuda*:*SwapTest*cuda*:*AFailedShare*cuda*:*KvCacheTest*cuda*:*FaultInjection*cuda_interleaved*' \
  > "$work/logs/memcheck_cpp.log" 2>&1 || { echo "memcheck: exit $? (124: ran out of time)"; status=1; }
grep -E "ERROR SUMMARY|PASSED|FAILED|tests ran" "$work/logs/memcheck_cpp.log" | tail -4

if [ -d ../.vattention ] && [ "$(budget 600)" -gt 130 ]; then
  PYTHONUNBUFFERED=1 timeout "$(budget 600)" python3 -m benchmarks.step_latency.arrivals_bench --only arrivals \
    --vattention ../.vattention --large-page-size 0 --out "$work/vattention" > "$work/logs/arrivals_vattention.log" 2>&1
fi

{
  cat "$work/gpu.txt"
  echo "== this tree"; grep -E "burst|prompt mapping" "$work/logs/arrivals_new.log"
  echo "== baseline $base"; grep -E "burst" "$work/logs/arrivals_base.log" 2>/dev/null || echo "not run"
  echo "== vattention"; grep -E "burst" "$work/logs/arrivals_vattention.log" 2>/dev/null || echo "not run"
  echo "== ctest (CUDA)"; grep -E "tests passed|Failed" "$work/logs/ctest_cuda.log" | tail -4
  echo "== pytest (GPU subset)"; tail -1 "$work/logs/pytest_gpu.log"
  echo "== memcheck"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$work/logs/memcheck_cpp.log" | tail -3
  echo "status $status, ${SECONDS}s"
} > "$out/summary.txt"
tar -czf "$out/results.tar.gz" -C "$out" results && rm -rf "$work"
cat "$out/summary.txt"
exit $status
