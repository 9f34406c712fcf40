# Sourced by the scripts: picks the Python that vkv is built, tested and run with, and sets
# VKV_PYTHON to it. That is the python3 on PATH, unless
#   - a virtual environment is active (VIRTUAL_ENV): its python;
#   - the system Python is externally managed (PEP 668: Debian's and Ubuntu's own Python
#     refuses pip installs), or VKV_VENV=1 (or --venv) asks: .venv in the checkout, made by
#     scripts/bootstrap.sh; it sees the system's packages when the system Python has torch
#     (a GPU machine's CUDA build), else it gets the CPU build of torch.

vkv_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vkv_base_python="${VKV_BASE_PYTHON:-python3}"

# The scripts' own flag: --venv anywhere in the arguments means VKV_VENV=1.
vkv_args=()
for vkv_arg in "$@"; do
  if [ "$vkv_arg" = "--venv" ]; then export VKV_VENV=1; else vkv_args+=("$vkv_arg"); fi
done

vkv_externally_managed() {
  "$vkv_base_python" - <<'PY'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if not in_venv and os.path.isfile(marker) else 1)
PY
}

if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  VKV_PYTHON="$VIRTUAL_ENV/bin/python"
  vkv_venv_reason=""
elif [ "${VKV_VENV:-0}" = 1 ]; then
  VKV_PYTHON="$vkv_root/.venv/bin/python"
  vkv_venv_reason="VKV_VENV=1"
elif vkv_externally_managed; then
  VKV_PYTHON="$vkv_root/.venv/bin/python"
  vkv_venv_reason="$(command -v "$vkv_base_python") is externally managed (PEP 668)"
else
  VKV_PYTHON="$(command -v "$vkv_base_python")"
  vkv_venv_reason=""
fi
export VKV_PYTHON

# The version .pre-commit-config.yaml pins for a hook repository: ruff or clang-format.
vkv_pinned_version() {
  local repo
  case "$1" in
    ruff) repo=ruff-pre-commit ;;
    clang-format) repo=mirrors-clang-format ;;
  esac
  awk -v repo="$repo" '$0 ~ "repo:.*/" repo "$" {found = 1; next}
    found && $1 == "rev:" {sub(/^v/, "", $2); print $2; exit}' "$vkv_root/.pre-commit-config.yaml"
}

# The clang-format scripts/lint.sh runs: the one pip installed into VKV_PYTHON's environment
# (scripts/bootstrap.sh --lint does where PATH has another version), else the one on PATH.
vkv_clang_format() {
  local scripts
  scripts="$("$VKV_PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)"
  if [ -n "$scripts" ] && [ -x "$scripts/clang-format" ]; then echo "$scripts/clang-format"; else echo clang-format; fi
}
vkv_clang_format_version() { "$1" --version 2>/dev/null | grep -o '[0-9][0-9.]*' | head -n1; }

# Of pip -v's output, passes on ninja's progress lines, vkv's CMake status lines and CMake's
# warnings and errors (whole), as they come.
vkv_build_progress() {
  local line warning=0
  while IFS= read -r line; do
    if [[ "$line" =~ ^\ *\[[0-9]+/[0-9]+\]\  || "$line" == *"-- vkv: "* || "$line" == ERROR* ]]; then
      printf '%s\n' "$line"
    elif [[ "$line" == *"CMake Warning"* || "$line" == *"CMake Error"* ]] || [ "$warning" = 1 ]; then
      printf '%s\n' "$line"
      warning=1
      if [[ "$line" =~ ^\ *$ ]]; then warning=0; fi
    fi
  done
  return 0
}

# Builds and installs vkv from the checkout into VKV_PYTHON (incremental: scikit-build-core
# keeps its build folder under build/), showing ninja's progress and CMake's warnings instead
# of minutes of silence; the whole log stays in build/pip-install.log (VKV_INSTALL_LOG).
# Extra arguments go to pip (--config-settings=build-dir=...).
vkv_install() {
  mkdir -p "$vkv_root/build"
  local log="${VKV_INSTALL_LOG:-$vkv_root/build/pip-install.log}" start=$SECONDS
  echo "== building and installing vkv into $VKV_PYTHON (a first build takes minutes; log: $log)"
  # pipefail here too: a caller without it would read the progress filter's status, not pip's.
  if ! (set -o pipefail; (cd "$vkv_root" && "$VKV_PYTHON" -m pip install -v --no-build-isolation --no-deps "$@" .) 2>&1 |
    tee "$log" | vkv_build_progress); then
    echo "== building vkv failed; the end of $log:" >&2
    tail -n 40 "$log" >&2
    return 1
  fi
  echo "== vkv built and installed in $((SECONDS - start)) s"
}
