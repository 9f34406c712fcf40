# FlashInfer for the benchmarks and the demo on a machine that cannot download it. Source it
# from the repository root:  [FLASHINFER_ARCHIVE=...] source scripts/gpu/flashinfer_env.sh
# (an environment variable, not an argument: a script sourced without arguments sees its
# caller's).
#
# Unpacks $FLASHINFER_ARCHIVE (default: the newest .whl/flashinfer-*.tar.xz, made by
# scripts/gpu/flashinfer_pack.py) into $FLASHINFER_SITE (default /tmp/site-flashinfer: a
# folder of its own, so that packages other runs put in /tmp/site do not mix in), once per
# machine and archive, or else installs the flashinfer_python and apache_tvm_ffi wheels found
# in .whl/ there, and exports
#   PYTHONPATH                 $FLASHINFER_SITE first
#   FLASHINFER_CUDA_ARCH_LIST  9.0a: what the shipped kernels were compiled for (H100)
#   FLASHINFER_WORKSPACE_BASE  /tmp/flashinfer-workspace: kernels compiled at first use are kept
#                              there, for later calls on the same (warm) machine
#   FLASHINFER_EXTRA_CUDAFLAGS + -isystem the archive's cuda_include/, where it has one and the
#                              toolkit has no curand_kernel.h (FA3 includes it through CUTLASS)
# It returns non-zero, and says why, where neither is found or the import fails.

flashinfer_site="${FLASHINFER_SITE:-/tmp/site-flashinfer}"
flashinfer_archive="${FLASHINFER_ARCHIVE:-$(ls -t .whl/flashinfer-*.tar.xz 2>/dev/null | head -1)}"
if [ -n "$flashinfer_archive" ] && [ -f "$flashinfer_archive" ]; then
  flashinfer_unpacked="$(basename "$flashinfer_archive") $(stat -c %s "$flashinfer_archive")"
  if [ "$(cat "$flashinfer_site/.unpacked" 2>/dev/null)" != "$flashinfer_unpacked" ]; then
    echo "flashinfer_env: unpacking $flashinfer_archive into $flashinfer_site"
    rm -rf "$flashinfer_site" && mkdir -p "$flashinfer_site" &&
      tar -xJf "$flashinfer_archive" -C "$flashinfer_site" &&
      echo "$flashinfer_unpacked" > "$flashinfer_site/.unpacked"
  fi
elif ls .whl/flashinfer_python-*.whl >/dev/null 2>&1; then
  if [ ! -d "$flashinfer_site/flashinfer" ]; then
    echo "flashinfer_env: installing the wheels of .whl/ into $flashinfer_site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$flashinfer_site" .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl
  fi
else
  echo "flashinfer_env: no .whl/flashinfer-*.tar.xz and no flashinfer_python wheel in .whl/" >&2
  false
fi &&
export PYTHONPATH="$flashinfer_site${PYTHONPATH:+:$PYTHONPATH}" &&
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}" &&
# (Not /tmp/flashinfer: tests run from /tmp, where that folder would import as `flashinfer`.)
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-workspace}" &&
if [ -d "$flashinfer_site/cuda_include" ] && [ ! -f "${CUDA_HOME:-/usr/local/cuda}/include/curand_kernel.h" ]; then
  export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $flashinfer_site/cuda_include${FLASHINFER_EXTRA_CUDAFLAGS:+ $FLASHINFER_EXTRA_CUDAFLAGS}"
fi &&
python3 -c 'import flashinfer, os; print("flashinfer_env: flashinfer", flashinfer.__version__, "from", os.path.dirname(flashinfer.__file__))'
