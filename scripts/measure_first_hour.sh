#!/usr/bin/env bash
# Measures the README's "first hour" as a newcomer meets it: clones this checkout's commit
# fresh into a temporary folder and times, there, the README's two commands in its order,
# each with VKV_VENV=1: scripts/demo.sh (then once more: "the second time"), then
# scripts/test.sh. Writes the times (wall clock, and the CPU time of everything they ran),
# the machine and its load, the commit and test.sh's summary lines to a JSON file: the
# README's numbers and example output come from it.
#   scripts/measure_first_hour.sh [OUT]
# OUT defaults to benchmarks/first_hour/results/first_hour_cpu_<cores>core_<commit>.json (the
# results' naming: what, the machine, the commit).
# About half an hour on a 2-core machine. Only committed work is measured (the clone is of
# HEAD); the logs stay in the temporary folder it prints, the clone (gigabytes) goes.
set -euo pipefail
cd "$(dirname "$0")/.."
commit="$(git rev-parse HEAD)"
out="${1:-benchmarks/first_hour/results/first_hour_cpu_$(nproc)core_$(git rev-parse --short HEAD).json}"
[ -z "$(git status --porcelain --untracked-files=no)" ] ||
  echo "measure_first_hour: uncommitted changes are not measured (the clone is of $commit)" >&2
work="$(mktemp -d "${TMPDIR:-/tmp}/vkv-first-hour.XXXXXX")"
echo "measure_first_hour: cloning $commit into $work/vkv; logs in $work"
git clone --quiet --no-hardlinks --no-checkout "$PWD" "$work/vkv"
git -C "$work/vkv" checkout --quiet "$commit"

# timed NAME COMMAND...: runs it in the clone with VKV_VENV=1, its output in $work/NAME.log;
# leaves "exit wall_s user_s sys_s" in $work/NAME.time and says it.
timed() {
  local name="$1" rc=0 TIMEFORMAT='%R %U %S'
  shift
  echo "== $name: VKV_VENV=1 $* (log: $work/$name.log)"
  { time (cd "$work/vkv" && env VKV_VENV=1 "$@" >"$work/$name.log" 2>&1); } 2>"$work/$name.clock" || rc=$?
  echo "$rc $(tail -n1 "$work/$name.clock")" >"$work/$name.time"
  read -r _ wall _ <"$work/$name.time"
  echo "   exit $rc after ${wall%.*} s"
}

load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
timed demo scripts/demo.sh
timed demo_again scripts/demo.sh
timed test scripts/test.sh
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"
cp -r "$work/vkv/build/test-logs" "$work/test-logs" 2>/dev/null || true
rm -rf "$work/vkv"

gpu="none"
if command -v nvidia-smi >/dev/null; then gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)"; fi
mkdir -p "$(dirname "$out")"
python3 - "$out" "$work" "$commit" "$gpu" "$load_before" "$load_after" <<'PY'
import json, os, platform, sys
out, work, commit, gpu, load_before, load_after = sys.argv[1:7]
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
memory_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))


def run(name, command):
    status, wall, user, system = open(os.path.join(work, name + ".time")).read().split()
    lines = open(os.path.join(work, name + ".log"), errors="replace").read().splitlines()
    return {"command": command, "exit_status": int(status), "wall_seconds": round(float(wall)),
            "cpu_seconds": round(float(user) + float(system)), "last_lines": lines[-3:], "lines": lines}


demo, again, test = (run("demo", "VKV_VENV=1 scripts/demo.sh"), run("demo_again", "VKV_VENV=1 scripts/demo.sh"),
                     run("test", "VKV_VENV=1 scripts/test.sh"))
# test.sh's closing lines, one per suite after "== summary" (log paths relative to the clone).
lines = test.pop("lines")
test["summary"] = lines[lines.index("== summary") + 1:] if "== summary" in lines else []
for record in (demo, again):
    record.pop("lines")
result = {
    "what": "the README's two commands on a fresh clone of the commit (git clone; each with VKV_VENV=1, so a "
            "fresh .venv), in the README's order; demo.sh run twice. wall_seconds: as a newcomer waits; "
            "cpu_seconds: user + system time of everything they ran (the load of other work does not change it)",
    "command": "scripts/measure_first_hour.sh",
    "commit": commit,
    "machine": {"cpu_cores": os.cpu_count(), "cpu": cpu, "memory_gib": round(memory_kib / 2**20), "gpu": gpu,
                "os": platform.platform(), "python": platform.python_version(),
                "load_average_1_5_15_min_before": load_before, "load_average_1_5_15_min_after": load_after},
    "demo_first_time": demo,
    "demo_second_time": again,
    "test": test,
}
with open(out, "w") as file:
    json.dump(result, file, indent=2)
    file.write("\n")
for name, record in (("demo.sh, first time", demo), ("demo.sh, second time", again), ("test.sh", test)):
    wall = record["wall_seconds"]
    print(f"{name}: exit {record['exit_status']} after {wall // 60} min {wall % 60} s "
          f"({record['cpu_seconds']} s of CPU time)")
print("\n".join(test["summary"]))
PY
echo "== wrote $out (logs in $work)"
ok=1
for name in demo demo_again test; do
  read -r rc _ <"$work/$name.time"
  [ "$rc" = 0 ] || ok=0
done
[ "$ok" = 1 ]
