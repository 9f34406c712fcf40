#!/usr/bin/env bash
# Runs tests/python/integrations/test_transformers_cache.py against the oldest and the newest
# transformers 5.x that vkv supports (pyproject.toml: transformers>=5.13,<6), each installed
# into a throwaway venv over the torch and the vkv that $PYTHON already has, so neither
# is rebuilt nor is the system's transformers touched.
#
#   scripts/test_transformers_versions.sh                  # the oldest (5.13.0) and the newest 5.x
#   scripts/test_transformers_versions.sh 5.17.0 '>=5,<6'  # any specs (pip's syntax after "transformers")
#   PYTHON=.venv/bin/python scripts/test_transformers_versions.sh
#
# Needs the registry (pip downloads transformers and what it lacks); vkv must be installed
# in $PYTHON (scripts/test.sh does that).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
# The oldest: 5.13.0, the first whose cache layers declare get_max_length (5.4 to 5.12 want
# get_max_cache_shape instead, and 5.0 to 5.3 a get_mask_sizes of cache_position).
oldest="==5.13.0"
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=("$oldest" ">=5,<6")

# Where vkv is installed: a .pth file puts it on the throwaway venvs' path (after their own
# site-packages, so their transformers wins over any other).
vkv_site="$(cd /tmp && "$python" -c 'import os, vkv; print(os.path.dirname(os.path.dirname(vkv.__file__)))')"
scratch="$(mktemp -d /tmp/vkv-transformers.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT

failed=()
for spec in "${specs[@]}"; do
  venv="$scratch/venv"
  rm -rf "$venv"
  start=$SECONDS
  "$python" -m venv --system-site-packages "$venv"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$vkv_site" > "$site/vkv_installed.pth"
  echo "transformers$spec: installing"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade "transformers$spec"
  version="$(cd /tmp && "$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
  echo "transformers$spec: testing $version"
  if (cd /tmp && "$venv/bin/python" -m pytest "$root/tests/python/integrations/test_transformers_cache.py" -q --tb=short -p no:cacheprovider); then
    echo "transformers $version: passed ($((SECONDS - start)) s)"
  else
    echo "transformers $version: FAILED ($((SECONDS - start)) s)"
    failed+=("$version")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "test_transformers_versions: failed with transformers ${failed[*]}" >&2
  exit 1
fi
