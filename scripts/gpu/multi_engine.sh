#!/usr/bin/env bash
# On the GPU host: the two-engine demo (python -m lab.multi_engine --preset h100: static
# halves, one shared budget, engine A solo, engine B SIGKILLed mid-burst) and the hand-off's
# goals: per engine the ask wait (stats()['budget_asks'], per ask) p99
# <= 5 ms and max <= 10 ms, combined throughput >= 1.3x the static split, nothing lost at
# the kill. About 5 minutes after the build (the demo stops at 8). The summary also splits
# the answers' time (unmap / release / count back) and shows, per engine, its bursts and the
# memory it held and used while the other's last burst ran: what bounds the makespan.
# --pressure-ms 0 (an argument for the demo) runs it as before shared_budget_pressure_ms;
# VKV_HANDOFF_COST=1 adds benchmarks/budget_handoff/reclaim_cost.py (one hand-off of N bytes, its split).
#   [VKV_GIT_COMMIT=<sha>] scripts/gpu/multi_engine.sh OUT_DIR [demo arguments...]
#   VKV_BUILD_ONLY=1 scripts/gpu/multi_engine.sh OUT_DIR    # the build alone, on a fresh machine
# Writes OUT_DIR/summary.txt (the goal table and the hand-off's breakdown) and
# OUT_DIR/results.tar.gz (the demo's JSON, plot and log, the GPU).
set -uo pipefail
cd "$(dirname "$0")/../.."
top="${1:?usage: scripts/gpu/multi_engine.sh OUT_DIR [demo arguments...]}"
shift
mkdir -p "$top"
top="$(cd "$top" && pwd)"
out="$top/results"  # packed at the end: the device tool returns few files
mkdir -p "$out"
source scripts/gpu/common.sh
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# The result JSON's provenance: pass VKV_GIT_COMMIT=<sha> where the copy has no .git.
commit="${VKV_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
[ -z "$commit" ] || export VKV_GIT_COMMIT="$commit"
echo "cores $(nproc); commit ${commit:-unknown}" | tee -a "$out/gpu.txt"
install_vkv || { echo "build failed"; exit 1; }
[ -z "${VKV_BUILD_ONLY:-}" ] || exit 0  # a first run that only builds (the next one skips it)
step multi_engine "${VKV_MULTI_SECONDS:-480}" env PYTHONUNBUFFERED=1 python3 -m lab.multi_engine --preset h100 --no-progress --out "$out" "$@"
# VKV_HANDOFF_COST=1: then one hand-off of 64 / 256 / 1024 MiB between two processes, its
# time split (readers, unmap, release, count back), 5 rounds each on 2 MiB pages (about a
# minute; scripts/gpu/reclaim_cost.sh runs the whole benchmark).
if [ -n "${VKV_HANDOFF_COST:-}" ]; then
  step reclaim_cost 180 python3 -m benchmarks.budget_handoff.reclaim_cost --device cuda --sizes-mib 64 256 1024 \
    --large-page-size-mib 0 --rounds 5 --out "$out"
fi

python3 - "$out" > "$top/summary.txt" <<'EOF'
import glob, json, sys
import numpy as np

out = sys.argv[1]
paths = sorted(glob.glob(f"{out}/multi_engine*.json"))
if not paths:
    print("no result JSON: see multi_engine.log")
    sys.exit(0)
r = json.load(open(paths[-1]))
print(f"{r['command']}  ({r['machine']}, {r['date']}, commit {str(r.get('provenance', {}).get('git_commit'))[:7]})")
print()
print("| phase | engine | asks | ask wait p50 / p99 / max ms | goal (p99 <= 5, max <= 10) |")
print("|---|---|---|---|---|")
for phase in ("shared", "kill"):
    for name, result in r["phases"].get(phase, {}).get(phase, {}).items():
        asks = result.get("asks_ms")
        if asks is None:
            continue
        if asks:
            p50, p99, top = np.percentile(asks, 50), np.percentile(asks, 99), max(asks)
            ok = "yes" if p99 <= 5 and top <= 10 else "NO"
            print(f"| {phase} | {name} | {len(asks)} | {p50:.2f} / {p99:.2f} / {top:.2f} | {ok} |")
        else:
            print(f"| {phase} | {name} | 0 | - | yes |")
ratio = r.get("shared_over_static")
c = r["combined"]
if ratio is not None:
    s, t = c["static"]["static"], c["shared"]["shared"]
    print(f"\ncombined: shared {t['throughput_tok_s']:.0f} tok/s (makespan {t['makespan_s']:.1f} s, "
          f"{t['preemptions']} preemptions), static {s['throughput_tok_s']:.0f} tok/s (makespan "
          f"{s['makespan_s']:.1f} s, {s['preemptions']} preemptions): x{ratio:.3f}  goal >= 1.3: "
          f"{'yes' if ratio >= 1.3 else 'NO'}")
if "kill" in r["phases"]:
    killed = r["phases"]["kill"]["kill"]["B"]["killed"]
    print(f"kill phase: B killed at {killed['at_s']:.2f} s, lost bytes {killed.get('lost_bytes')}, "
          f"A {c['kill']['kill']['throughput_tok_s']:.0f} tok/s")
print(f"left after every phase: {r['left_after']['used_bytes']} bytes used, {len(r['left_after']['members'])} members")
print("\nhand-off breakdown (totals per engine and phase; ms):")
print("| phase | engine | asks | ask wait | of it: own lock | answers | answering | of it: waiting for its lock "
      "| of it: device work | of it: unmap / release / count | pages given | of them: by its own calls "
      "| given unasked when idle | given under pressure (ms) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for phase, variants in r["phases"].items():
    for label, results in variants.items():
        for name, result in results.items():
            h = result.get("handoff")
            if not h or not (h["asks"] or h["answers"] or h.get("idle_pages") or h.get("pressure_pages")):
                continue
            split = " / ".join(f"{h.get(key, 0) * 1e3:.1f}" for key in
                               ("answer_unmap_seconds", "answer_release_seconds", "answer_count_seconds"))
            print(f"| {label} | {name} | {h['asks']} | {h['ask_seconds'] * 1e3:.1f} | {h['ask_relock_seconds'] * 1e3:.1f} "
                  f"| {h['answers']} | {h['answer_seconds'] * 1e3:.1f} | {h['answer_lock_wait_seconds'] * 1e3:.1f} "
                  f"| {h['answer_event_wait_seconds'] * 1e3:.1f} | {split} | {h['answer_pages']} "
                  f"| {h['answer_pages_in_calls']} | {h.get('idle_pages', 0)} "
                  f"| {h.get('pressure_pages', 0)} ({h.get('pressure_seconds', 0) * 1e3:.1f}) |")
# What bounds the makespan: each engine's bursts, and per engine the memory it held and
# used while the other's last burst ran (the samples: seconds, bytes created, bytes in use).
shared = r["phases"].get("shared", {}).get("shared", {})
if shared:
    print("\nshared phase, per engine: bursts served in (s); at the last burst's start + 0/1/2/3 s: "
          "held / in use MiB")
    last = max(result["finished_s"] - result["bursts_s"][-1] for result in shared.values() if "bursts_s" in result)
    for name, result in shared.items():
        samples = np.array(result.get("samples") or [[0, 0, 0]])
        points = []
        for offset in (0, 1, 2, 3):
            i = min(np.searchsorted(samples[:, 0], last + offset), len(samples) - 1)
            points.append(f"{samples[i, 1] / 2**20:.0f} / {samples[i, 2] / 2**20:.0f}")
        s = result["summary"]
        print(f"  {name}: {' / '.join(f'{b:.2f}' for b in result['bursts_s'])}; {' | '.join(points)}; "
              f"step() total {sum(result['step_us']) / 1e6:.2f} s, of it > 1 ms {sum(x for x in result['step_us'] if x > 1000) / 1e6:.2f} s; "
              f"GPU busy {s['gpu_busy_pct']:.0f}%, decode step p50 {s['decode_step_ms_p50']:.2f} ms, TTFT p50 {s['ttft_p50_ms']:.0f} ms")
        slow = result.get("slow_steps") or {}
        if slow.get("steps"):
            parts = ", ".join(f"{key[:-3]} {slow.get(key, 0) / 1e9:.2f}" for key in
                              ("ask_ns", "lock_wait_ns", "mapper_wait_ns", "map_ns", "event_wait_ns", "fills_ns",
                               "plan_ns", "finish_ns"))
            print(f"     its {slow['steps']:.0f} steps over 1 ms: {slow['wall_ns'] / 1e9:.2f} s, of it (s) {parts}; "
                  f"{slow.get('pages_mapped', 0):.0f} pages mapped")
EOF
cat "$top/summary.txt"
cp "$top/summary.txt" "$out/"
tar czf "$top/results.tar.gz" -C "$top" results && rm -rf "$out"
exit $status
