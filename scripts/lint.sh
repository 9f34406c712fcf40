#!/usr/bin/env bash
# Checks the C++ format (clang-format, .clang-format), the Python lint (ruff, configured in
# pyproject.toml: the whole tree) and the typed package's types (mypy: python/vkv; lab/ and
# benchmarks/, programs run from a checkout, are left out).
# clang-format and ruff run at the versions .pre-commit-config.yaml pins (scripts/bootstrap.sh
# --lint installs them where they are missing), so CI, this script and pre-commit agree.
#   scripts/lint.sh          check; exit 1 on any finding
#   scripts/lint.sh --fix    apply clang-format and ruff's fixes, then check
# VKV_LINT_CLANG_FORMAT=0 skips the clang-format part (while the tree is not yet formatted).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
fix=0
for arg in "${vkv_args[@]}"; do
  case "$arg" in
    --fix) fix=1 ;;
    *) echo "lint: unknown argument $arg (expected --fix, --venv)" >&2; exit 2 ;;
  esac
done
bash scripts/bootstrap.sh --demo --lint >/dev/null
failed=0

if [ "${VKV_LINT_CLANG_FORMAT:-1}" = 0 ]; then
  echo "== clang-format: skipped (VKV_LINT_CLANG_FORMAT=0)"
else
  clang_format="$(vkv_clang_format)"
  mapfile -t cxx_files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh' ':!:*/third_party/*')
  if [ "$fix" = 1 ]; then
    echo "== clang-format: formatting ${#cxx_files[@]} files"
    "$clang_format" -i --style=file "${cxx_files[@]}"
  fi
  echo "== clang-format $(vkv_clang_format_version "$clang_format"): ${#cxx_files[@]} files"
  unformatted=0 lines=0
  for file in "${cxx_files[@]}"; do
    changed="$("$clang_format" --style=file "$file" | diff "$file" - | grep -c '^<' || true)"
    if [ "$changed" != 0 ]; then
      echo "  $file: $changed lines differ from clang-format's"
      unformatted=$((unformatted + 1)) lines=$((lines + changed))
    fi
  done
  if [ "$unformatted" != 0 ]; then
    echo "  $unformatted files, $lines lines to format (scripts/lint.sh --fix formats them)"
    failed=1
  fi
fi

echo "== ruff $("$VKV_PYTHON" -m ruff --version | cut -d' ' -f2)"
if [ "$fix" = 1 ]; then "$VKV_PYTHON" -m ruff check --fix --quiet . || true; fi
"$VKV_PYTHON" -m ruff check . || failed=1

echo "== the supported torch releases, where the repository states them (scripts/generate_torch_support.py)"
"$VKV_PYTHON" scripts/generate_torch_support.py --check || failed=1

echo "== mypy (python/vkv)"
"$VKV_PYTHON" -m mypy || failed=1

[ "$failed" = 0 ] && echo "== lint: clean" || echo "== lint: findings above (scripts/lint.sh --fix applies the formatters)"
exit "$failed"
