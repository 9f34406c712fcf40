#!/usr/bin/env bash
# On the GPU host: several engines on one GPU, vkv's shared budget against kvcached 0.1.6 and
# a static split, each measured in the same run (python -m lab.multi_engine), and the summary
# against the goals:
#   kvcached3   3 x Llama-3.1-8B shape, staggered ramp-up/ramp-down rates, 256-token prompts:
#               vkv TTFT p99 <= kvcached's and <= half the static split's, vkv combined tok/s
#               >= kvcached's, vkv fails 0 requests
#   contention  2 engines burst at the same instant, each wanting 70% of the KV memory: vkv
#               fails 0 requests; kvcached's count reported
#   mixed4      4 engines of mixed shapes (8B, 3B, 1B), staggered bursts: vkv >= 1.5x static,
#               0 failed, every engine's TTFT p99
#   mixed8      8 engines of mixed shapes
#   h100        the two-engine preset against its ceiling (each engine alone with all of the
#               KV memory): phases static shared alone
#   [VKV_GIT_COMMIT=<sha>] scripts/gpu/multi_engine_vs_kvcached.sh OUT_DIR [PRESET...] [-- demo arguments...]
# One preset per call fits a 10-minute limit with the build (default: kvcached3); more run one
# after the other. VKV_BUILD_ONLY=1: vkv, kvcached and FlashInfer only, then kvcached's own
# check (kvcached_build.sh --check) and tests/lab/stores/test_kvcached_store.py (the engine's
# tokens on kvcached's blocks equal a paged pool's): a first call on a fresh machine; the next
# calls skip the builds. VKV_MULTI_SECONDS (default 540) bounds each preset's run, and all of
# them end VKV_DEADLINE_S (default 580) seconds after the script started (a stopped run keeps
# the phases it finished); --scale S (a demo argument) shortens the traces. kvcached is built by scripts/gpu/kvcached_build.sh from
# .whl/kvcached-0.1.6.tar.gz and FlashInfer comes from scripts/gpu/flashinfer_env.sh (.whl/).
# Writes OUT_DIR/summary.txt and OUT_DIR/results.tar.gz (JSON, plots, logs, the GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
src="$PWD"
top="${1:?usage: scripts/gpu/multi_engine_vs_kvcached.sh OUT_DIR [PRESET...] [-- demo arguments...]}"
shift
presets=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do presets+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#presets[@]} -gt 0 ] || presets=(kvcached3)
mkdir -p "$top"
top="$(cd "$top" && pwd)"
out="$top/results"
mkdir -p "$out"
source scripts/gpu/common.sh
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
commit="${VKV_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
[ -z "$commit" ] || export VKV_GIT_COMMIT="$commit"
echo "cores $(nproc); commit ${commit:-unknown}" | tee -a "$out/gpu.txt"
install_vkv || { echo "build failed"; exit 1; }
# kvcached and FlashInfer: a phase that cannot run says why in the summary, the rest run.
if bash scripts/gpu/kvcached_build.sh > "$out/kvcached_build.log" 2>&1; then
  source "${KVCACHED_SITE:-/tmp/kvcached-site}/env.sh"
fi
tail -4 "$out/kvcached_build.log"
source scripts/gpu/flashinfer_env.sh || echo "FlashInfer unavailable: the flashinfer phases say why"
export PYTHONUNBUFFERED=1
if [ -n "${VKV_BUILD_ONLY:-}" ]; then  # a first call: the builds (a warm machine keeps them in /tmp) and checks
  step kvcached_check 120 bash "$src/scripts/gpu/kvcached_build.sh" --check
  step kvcached_store_test 300 python3 -m pytest "$src/tests/lab/stores/test_kvcached_store.py" -q -p no:cacheprovider -rs
  tar czf "$top/results.tar.gz" -C "$top" results && rm -rf "$out"
  exit $status
fi
for preset in "${presets[@]}"; do
  extra=()
  [ "$preset" = h100 ] && extra=(--phases static shared alone)
  # Within the call's 10 minutes: the demo is stopped (SIGTERM: it ends its engines and keeps
  # the JSON of the phases done) in time for the summary.
  limit=$(( ${VKV_DEADLINE_S:-580} - SECONDS ))
  [ "$limit" -le "${VKV_MULTI_SECONDS:-540}" ] || limit="${VKV_MULTI_SECONDS:-540}"
  if [ "$limit" -lt 30 ]; then echo "=== multi_$preset: skipped, ${limit} s left of VKV_DEADLINE_S"; status=1; continue; fi
  step "multi_$preset" "$limit" python3 -m lab.multi_engine --preset "$preset" --out "$out" "${extra[@]}" "$@"
done

python3 - "$out" > "$top/summary.txt" <<'EOF'
import glob, json, math, sys

out = sys.argv[1]
paths = sorted(glob.glob(f"{out}/multi_engine_*.json"))
if not paths:
    print("no result JSON: see the multi_*.log files")
    sys.exit(0)


def shown(value, digits=2):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


for path in paths:
    r = json.load(open(path))
    commit = str(r.get("provenance", {}).get("git_commit"))[:7]
    print(f"== {r['config']['preset']}: {r['command']}  ({r['machine']}, {r['date']}, commit {commit})"
          + ("  PARTIAL: stopped after the phases below" if r.get("partial") else ""))
    print("| phase | engine | model | tok/s | TTFT p50 / p99 ms | preempted | failed | idle holds MiB p50 / max |")
    print("|---|---|---|---|---|---|---|---|")
    models = r["config"]["models"]
    for phase, variants in r["phases"].items():
        for label, results in variants.items():
            for name, result in results.items():
                if name.startswith("_") or "killed" in result:
                    continue
                s = result.get("summary") or {}
                idle = result.get("idle") or {}
                held = " / ".join("-" if idle.get(k) is None else f"{idle[k] / 2**20:.0f}"
                                  for k in ("held_p50_bytes", "held_max_bytes"))
                print(f"| {label} | {name} | {models[ord(name) - ord('A')]} | {shown(s.get('throughput_tok_s'), 0)} | "
                      f"{shown(s.get('ttft_p50_ms'), 0)} / {shown(s.get('ttft_p99_ms'), 0)} | "
                      f"{s.get('preemptions', '-')} | {result.get('failed', '-')} | {held} |")
    print("\n| phase | combined tok/s | makespan s | TTFT p50 / p99 ms | preemptions | failed |")
    print("|---|---|---|---|---|---|")
    for phase, labels in r["combined"].items():
        for label, c in labels.items():
            print(f"| {label} | {shown(c['throughput_tok_s'], 0)} | {shown(c['makespan_s'], 1)} | "
                  f"{shown(c['ttft_p50_ms'], 0)} / {shown(c['ttft_p99_ms'], 0)} | {c['preemptions']} | {c['failed']} |")
    for labels in r["phases"].values():
        for label, results in labels.items():
            pool = results.get("_kvcached_pool")
            if pool:
                print(f"{label}: kvcached's pool {pool['pool_bytes'] / 2**20:.0f} MiB (KV memory "
                      f"{pool['kv_budget_bytes'] / 2**20:.0f} MiB){': ' + pool['warning'] if pool.get('warning') else ''}")
            for name, result in results.items():
                k = result.get("kvcached") if isinstance(result, dict) else None
                if k:
                    limit = k.get("limit") or {}
                    print(f"{label} {name}: kvcached limit {(limit.get('limit_bytes') or 0) / 2**20:.0f} MiB, "
                          f"{k['misses']} allocs refused, {k['error_count']} errors"
                          f"{': ' + k['errors'][0] if k['errors'] else ''}")
                if isinstance(result, dict) and result.get("error"):
                    print(f"{label} {name}: the engine failed: {result['error'].strip().splitlines()[-1]}")
    for phase, reason in r.get("unavailable", {}).items():
        print(f"{phase}: not run: {reason}")
    for phase, reason in r.get("errors", {}).items():
        print(f"{phase}: failed: {reason.strip().splitlines()[-1] if reason.strip() else reason}")
    if r.get("goals"):
        print("\n| goal | vkv | against | met |\n|---|---|---|---|")
        for g in r["goals"]:
            met = "-" if g["met"] is None else ("yes" if g["met"] else "NO")
            print(f"| {g['goal']} | {shown(g['vkv'])} | {shown(g['against'])} | {met} |")
    print()
EOF
cat "$top/summary.txt"
cp "$top/summary.txt" "$out/"
tar czf "$top/results.tar.gz" -C "$top" results && rm -rf "$out"
exit $status
