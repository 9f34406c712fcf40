# Shell helpers of the GPU runners (scripts/gpu/*.sh); source it from the
# repository root after setting `out` (the log folder) and `status=0`.

# lab/ and benchmarks/ run from this checkout (python3 -m lab.serving, python3 -m
# benchmarks.<question>.<script>), over the installed vkv, from any directory.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME TIMEOUT_S COMMAND...: from /tmp, so that the installed vkv is imported
  local name="$1" limit="$2"
  shift 2
  echo "=== $name ($(date +%T))"
  (cd /tmp && timeout "$limit" "$@") > "$out/$name.log" 2>&1
  local rc=$?
  tail -25 "$out/$name.log"
  echo "=== $name: exit $rc ($(date +%T))"
  [ $rc -eq 0 ] || status=1
}

install_vkv() {  # pip-installs this tree once per machine and source tree; non-zero if that failed
  local stamp log=/tmp/vkv-install.log
  stamp=$(tar cf - CMakeLists.txt pyproject.toml include src csrc python 2>/dev/null | sha256sum | cut -c1-16)
  if [ "$(cat /tmp/vkv-installed 2>/dev/null)" != "$stamp" ]; then
    echo "=== building vkv ($(date +%T))"
    # The stamp only once pip succeeded: a failed build is built again next time, and says so now.
    if ! python3 -m pip install -q --no-build-isolation --no-deps . > "$log" 2>&1; then
      tail -30 "$log"
      echo "install_vkv: pip install failed (log: $log)" >&2
      rm -f /tmp/vkv-installed
      return 1
    fi
    grep -v WARNING "$log" | tail -5
    echo "$stamp" > /tmp/vkv-installed
  fi
}

tree_commit() {  # the commit this tree is: VKV_GIT_COMMIT where the copy's .git is stale or absent
  if [ -n "${VKV_GIT_COMMIT:-}" ]; then
    echo "$VKV_GIT_COMMIT"
  else
    echo "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (dirty)')"
  fi
}
