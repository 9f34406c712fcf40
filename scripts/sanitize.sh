#!/usr/bin/env bash
# Builds the C++ tests with AddressSanitizer + UndefinedBehaviorSanitizer, and with
# ThreadSanitizer (the mapper thread included), and runs them. Randomized tests run
# shorter here: sanitizers slow them 5-20x, and the plain build runs them at full length.
#   scripts/sanitize.sh [address,undefined|thread ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
sanitizers=("$@")
[ ${#sanitizers[@]} -gt 0 ] || sanitizers=("address,undefined" "thread")
for sanitizer in "${sanitizers[@]}"; do
  build="build-${sanitizer//,/-}"
  echo "== $sanitizer"
  # -O1 and line tables (-g1), not RelWithDebInfo's -O2 -g: a test file compiles about 3x
  # faster under the sanitizers (41 s against 14 s for tests/cpp/cache/test_sharing.cpp under
  # ASan+UBSan on a 2-core machine), and the reports still name every frame's file and line.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DVKV_SANITIZE="$sanitizer" -DVKV_ASSERTS=ON -DVKV_BUILD_EXAMPLES=OFF -DVKV_BUILD_BENCHMARKS=OFF >/dev/null
  cmake --build "$build"
  # Death tests, and the tests of processes that die, fork a process that starts threads,
  # which ThreadSanitizer does not support (its own thread makes every process multi-threaded).
  exclude="install_and_find_package|configure_without_cuda_headers"
  [ "$sanitizer" = "thread" ] && exclude="$exclude|UnmappedMemoryReadsAsZerosAndFaultsOnWrites|OffTheHostBackendReadsZerosPastWhatStepBacked|StillFault|MapsNothing|Fork\.|Killed"
  VKV_MODEL_OPS=600 VKV_FAULT_EVERY=5 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 TSAN_OPTIONS=halt_on_error=1 \
    ctest --test-dir "$build" --output-on-failure -j"$(nproc)" -E "$exclude"
done
