#!/usr/bin/env bash
# On a fresh GPU machine, within ~6 minutes including the builds: step()'s tail in the
# arrival trace (benchmarks/step_latency/) with the per-iteration breakdown, for this tree and for
# each BASE beside it on the same GPU: both layouts, one finish + arrival every 10 and
# every 2 iterations; then this tree with the mapper off and without eager allocation (how
# much of the tail the mapper's work causes). Prints the goal table (step p99 <= 100 us
# over all and over decode-only iterations, free_reqid p50 <= 20 us, alloc_reqid p50 <= 10 us).
#   scripts/gpu/step_tail.sh OUT_DIR [BASE...]    # OUT_DIR/summary.txt, OUT_DIR/results.tar.gz
# BASE: a source folder (a copy of another commit's tree) or a commit git can archive here;
# default: 3aad7d7 (the commit before facf77b, the fill's move from alloc_reqid to step).
set -uo pipefail
cd "$(dirname "$0")/../.."
top="${1:?usage: scripts/gpu/step_tail.sh OUT_DIR [BASE...]}"
shift
out="$top/results"  # packed into OUT_DIR/results.tar.gz at the end: the device tool returns few files
bases=("$@")
[ ${#bases[@]} -gt 0 ] || bases=(3aad7d7)
mkdir -p "$out/logs"
deadline=$((SECONDS + ${VKV_GPU_SECONDS:-350}))
left() { local l=$((deadline - SECONDS)); l=$((l < $1 ? l : $1)); echo $((l > 1 ? l : 1)); }
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
source scripts/gpu/common.sh  # tree_commit
echo "cores $(nproc); commit $(tree_commit)" | tee -a "$out/gpu.txt"
export CMAKE_BUILD_PARALLEL_LEVEL=$(( $(nproc) / (${#bases[@]} + 1) > 2 ? $(nproc) / (${#bases[@]} + 1) : 2 ))

# Every tree builds at once: this one into the system's Python, each base into its own folder.
python3 -m pip install -q --no-build-isolation --no-deps . > "$out/logs/build_this.log" 2>&1 &
pids=($!)
names=(this)
paths=("")
for i in "${!bases[@]}"; do
  base="${bases[$i]}"
  src="$base"
  if [ ! -d "$src" ]; then
    src="/tmp/vkv-base-src-$i"
    rm -rf "$src" && mkdir -p "$src"
    if ! git archive "$base" 2>/dev/null | tar -x -C "$src"; then
      echo "no tree for base $base: not run"
      pids+=(""); names+=("base-$base"); paths+=(FAILED)
      continue
    fi
  fi
  rm -rf "/tmp/vkv-base-$i"
  python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/vkv-base-$i" "$src" \
    > "$out/logs/build_base$i.log" 2>&1 &
  pids+=($!)
  names+=("base-$(basename "$base")")
  paths+=("/tmp/vkv-base-$i")
done
for i in "${!pids[@]}"; do
  log="$out/logs/build_this.log"
  [ "$i" = 0 ] || log="$out/logs/build_base$((i - 1)).log"
  [ -n "${pids[$i]}" ] || continue
  wait "${pids[$i]}" || { echo "build of ${names[$i]} failed:"; tail -5 "$log"; paths[$i]=FAILED; }
done
echo "builds done at ${SECONDS}s"
[ "${paths[0]}" != FAILED ] || status=1

checkout="$PWD"  # the harness: this tree's benchmarks/, over each tree's vkv
run() {  # run NAME TREE-INDEX LIMIT ARGS...: the arrival trace with this tree's harness, from /tmp
  local name="$1" index="$2" limit="$3"
  shift 3
  [ "${paths[$index]}" != FAILED ] || return
  [ $((deadline - SECONDS)) -gt 15 ] || { echo "$name: no time left"; return; }
  (cd /tmp && PYTHONPATH="${paths[$index]:+${paths[$index]}:}$checkout" PYTHONUNBUFFERED=1 timeout "$(left "$limit")" \
    python3 -m benchmarks.step_latency.arrivals_bench --only arrivals --large-page-size 0 --out "$out" --tag "_$name" "$@") > "$out/logs/$name.log" 2>&1 \
    || { echo "$name: exit $?"; [ "$index" != 0 ] || status=1; }
  grep -E "step\(\) all|free_reqid inside" "$out/logs/$name.log" | sed "s/^/$name: /"
}
run this_every10 0 60
for i in "${!bases[@]}"; do run "${names[$((i + 1))]}_every10" $((i + 1)) 60; done
run this_every2 0 60 --every 2
for i in "${!bases[@]}"; do run "${names[$((i + 1))]}_every2" $((i + 1)) 60 --every 2; done
run this_every10_nomapper 0 45 --layouts interleaved --option background_mapping=False
run this_every10_noeager 0 45 --layouts interleaved --option eager_tokens=0
run this_every10_repeat 0 60

python3 -m benchmarks.step_latency.step_tail_table "$out"/arrivals_*.json | tee "$out/summary.txt"
echo "bases: ${bases[*]}; status $status, ${SECONDS}s" | tee -a "$out/summary.txt"
cp "$out/summary.txt" "$top/summary.txt"
tar -czf "$top/results.tar.gz" -C "$top" results && rm -rf "$out"
exit $status
