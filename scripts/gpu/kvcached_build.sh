#!/usr/bin/env bash
# kvcached 0.1.6 (github.com/ovg-project/kvcached), built from its source package on the GPU
# machine, for the multi-engine comparison (python -m lab.multi_engine, phase kvcached).
#   scripts/gpu/kvcached_build.sh [--check]
# Needs, in the repository's .whl/ (ignored by git; fetched on a machine with network):
#   kvcached-0.1.6.tar.gz                    its source package, as the package index serves it
#   posix_ipc-*-cp312-*manylinux*.whl        its one dependency the GPU image lacks
# and on the machine: python3 with torch (CUDA), numpy, wrapt, setuptools, g++ and the CUDA
# toolkit's headers (it compiles a small C++ extension against the installed torch).
# Builds once per machine and archive into $KVCACHED_SITE (default /tmp/kvcached-site; a
# warm machine keeps /tmp), writes $KVCACHED_SITE/env.sh and prints how to use it:
#   PYTHONPATH   $KVCACHED_SITE first
#   LD_PRELOAD   the system's libstdc++.so.6, the one torch loads: without it kvcached's C++
#                PageAllocator dies with SIGSEGV at its first std::cout. The demo sets it for
#                the engine processes it starts; anything else that makes a kvcached pool
#                needs it in its own environment.
# --check also makes a kvcached pool on cuda:0 (the Llama-3-8B shape) with LD_PRELOAD set and
# times alloc(256) / free / trim.
set -uo pipefail
cd "$(dirname "$0")/../.."
site="${KVCACHED_SITE:-/tmp/kvcached-site}"
archive="$(ls .whl/kvcached-0.1.6.tar.gz 2>/dev/null | head -1)"
wheel="$(ls .whl/posix_ipc-*cp312*manylinux*x86_64*.whl 2>/dev/null | head -1)"
if [ -z "$archive" ] || [ -z "$wheel" ]; then
  echo "kvcached_build: .whl/ lacks kvcached-0.1.6.tar.gz or a posix_ipc cp312 manylinux wheel" >&2
  exit 1
fi
stamp="$(sha256sum "$archive" "$wheel" | sha256sum | cut -c1-16)"
if [ "$(cat "$site/.built" 2>/dev/null)" != "$stamp" ]; then
  echo "=== building kvcached from $archive into $site ($(date +%T))"
  work="$(mktemp -d)"
  tar -xzf "$archive" -C "$work" || exit 1
  rm -rf "$site" && mkdir -p "$site"
  # --no-build-isolation: against the installed torch (its build needs torch >= 2.10);
  # --target: a folder of its own (its .pth autopatch is not run from there, which the demo
  # does not want: it calls kvcached's interfaces itself).
  if ! (cd "$work/kvcached-0.1.6" && MAX_JOBS="${MAX_JOBS:-16}" python3 -m pip install -q --no-build-isolation \
          --no-deps --no-index --target "$site" . "$OLDPWD/$wheel") > "$work/build.log" 2>&1; then
    tail -30 "$work/build.log"
    echo "kvcached_build: pip install failed (log: $work/build.log)" >&2
    exit 1
  fi
  echo "$stamp" > "$site/.built"
  rm -rf "$work"
  echo "=== built ($(date +%T))"
fi
# The libstdc++ that torch loads, from the maps of a python that imported it; else ldconfig's.
libstdcxx="$(python3 -c 'import torch, re
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    if re.search(r"/libstdc\+\+\.so\.6(\.[0-9.]+)?$", path):
        print(path); break' 2>/dev/null)"
if [ -z "$libstdcxx" ]; then
  libstdcxx="$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')"
fi
cat > "$site/env.sh" <<EOF
export PYTHONPATH="$site\${PYTHONPATH:+:\$PYTHONPATH}"
export KVCACHED_LD_PRELOAD="$libstdcxx"   # LD_PRELOAD this in a process that makes a kvcached pool
EOF
echo "kvcached 0.1.6 in $site; the C++ runtime torch loads: ${libstdcxx:-NOT FOUND}"
echo "use it:  source $site/env.sh   (python -m lab.multi_engine preloads \$KVCACHED_LD_PRELOAD in its kvcached engines)"
echo "         elsewhere: LD_PRELOAD=$libstdcxx PYTHONPATH=$site python3 ..."
if [ "${1:-}" = "--check" ]; then
  (cd /tmp && LD_PRELOAD="$libstdcxx" PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" KVCACHED_IPC_NAME="vkv_check_$$" \
    KVCACHED_LOG_LEVEL=WARNING timeout 120 python3 - <<'EOF'
import time, torch
from kvcached.integration.vllm import interfaces as kvi
kvi.init_kvcached(device="cuda:0", is_worker=True)
layers, heads, dim, block = 32, 8, 128, 16
began = time.perf_counter()
views = kvi.alloc_kv_cache((1, 2, block, heads, dim), block, torch.bfloat16, "cuda:0", layers)
manager = kvi.get_kv_cache_manager(None, block, heads * dim * 2, layers)
made = time.perf_counter() - began
print(f"kvcached pool: {len(views)} views of {tuple(views[0].shape)} (strides {views[0].stride()}), "
      f"{manager.available_size()} blocks available, made in {made:.2f} s")
began = time.perf_counter(); blocks = manager.alloc(256); took = time.perf_counter() - began
print(f"alloc(256): {took * 1e3:.1f} ms")
began = time.perf_counter(); manager.free(blocks); print(f"free: {(time.perf_counter() - began) * 1e3:.1f} ms")
began = time.perf_counter(); manager.trim(); print(f"trim: {(time.perf_counter() - began) * 1e3:.1f} ms")
kvi.shutdown_kvcached()
print("kvcached check: ok")
import os; os._exit(0)
EOF
    )
fi
