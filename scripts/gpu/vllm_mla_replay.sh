#!/usr/bin/env bash
# vLLM connector replay for MLA on CUDA (one H100; est. ≤ 6 minutes with vkv's build and
# FlashInfer's MLA compile): the block decisions recorded on a CPU with vLLM 0.33's real
# scheduler seeing DeepSeek-V2-Lite's MLA cache (benchmarks/vllm_replay/traces/vllm_trace_mla.json: 64
# requests of 100-154 prompt tokens and 160 generated, 32-token blocks as vLLM's FlashInfer MLA
# backend takes them) replayed over vkv memory and over a torch.zeros pool: 27 layers of one
# 576-wide latent vector a token (kv_lora_rank 512 + qk_rope_head_dim 64, bf16), 995,328 B a
# block (the connector's PageMemory on 2 MiB pages, on the background mapper), attention by
# FlashInfer's MLA kernel (BatchMLAPagedAttentionWrapper, FA2) over ckv = cache[..., :512] and
# kpe = cache[..., 512:] of vLLM's per-layer views, with DeepSeek-V2-Lite's active weight GEMMs
# (--dense). Asserts the outputs bitwise equal; prints steps, blocks, µs per block map/unmap and
# the per-step overhead at decode batch 60-64. First the MLA block's GPU placement tests.
# Needs a .whl/flashinfer-*.tar.xz with FlashInfer's MLA sources (scripts/gpu/flashinfer_pack.py
# packs them; scripts/gpu/flashinfer_env.sh unpacks it).
#   scripts/gpu/vllm_mla_replay.sh OUT   results: OUT/vllm_mla_replay.json (GPU, commit, command,
#                                        verdict), OUT/vllm_replay_mla_flashinfer_bg_dense.json,
#                                        OUT/*.log, OUT/summary.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:?no OUT given and \$OUT unset}}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"  # the steps run from /tmp
src="$PWD"
export PYTHONUNBUFFERED=1 OUT="$out"  # where vllm_mla_replay.py writes its JSON
status=0
command_line="scripts/gpu/vllm_mla_replay.sh $*"

# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# The archive flashinfer_env.sh will unpack must have MLA's sources: said before vkv's build.
archive="${FLASHINFER_ARCHIVE:-$(ls -t .whl/flashinfer-*.tar.xz 2>/dev/null | head -1)}"
if [ -n "$archive" ] && ! tar -tJf "$archive" | grep "flashinfer/data/csrc/batch_mla_run.cu" > /dev/null; then
  echo "vllm_mla_replay: $archive has no MLA sources: pack one with scripts/gpu/flashinfer_pack.py (it keeps them)" |
    tee "$out/summary.txt"
  exit 1
fi
install_vkv || exit 1
# shellcheck source=scripts/gpu/flashinfer_env.sh
source scripts/gpu/flashinfer_env.sh || exit 1
if ! python3 - <<'EOF'; then
import sys
from flashinfer.jit import env
names = ["batch_mla_plan.cu", "batch_mla_run.cu", "batch_mla_binding.cu", "batch_mla_config.jinja"]
missing = [n for n in names if not (env.FLASHINFER_CSRC_DIR / n).is_file()]
if missing:
    sys.exit(f"vllm_mla_replay: the FlashInfer archive has no MLA sources ({', '.join(missing)} not in "
             f"{env.FLASHINFER_CSRC_DIR}): pack one with scripts/gpu/flashinfer_pack.py (it keeps them)")
EOF
  exit 1
fi
echo "tree $(tree_commit)" | tee "$out/summary.txt"

step mla_gpu_tests 150 python3 -m pytest "$src/tests/python/integrations/vllm_connector/test_vllm_gpu_placement.py" \
  -q -p no:cacheprovider -rs -k mla
echo "mla_gpu_tests: $(tail -1 "$out/mla_gpu_tests.log")" | tee -a "$out/summary.txt"
tests_status=$status

replay=(python3 -m benchmarks.vllm_replay.vllm_mla_replay replay "$src/benchmarks/vllm_replay/traces/vllm_trace_mla.json" --device cuda
        --attention flashinfer --dense --mapping background --keep-going)
# FlashInfer compiles its MLA module (FA2) at the first plan, before the timed steps. --keep-going:
# steps whose outputs differ are listed in the JSON (and the run exits 1), not cut short.
step mla_replay 330 "${replay[@]}" --backend fa2
backend=fa2
if ! grep -q "MLA kernels ready" "$out/mla_replay.log"; then
  # FA2's MLA module did not build or plan here: FA3's (sm90), once.
  echo "mla: FA2's MLA kernel did not start; FA3's" | tee -a "$out/summary.txt"
  status=$tests_status
  step mla_replay_fa3 300 "${replay[@]}" --backend fa3
  cp "$out/mla_replay_fa3.log" "$out/mla_replay.log"
  backend=fa3
fi
grep "^mla:" "$out/mla_replay.log" | tee -a "$out/summary.txt"

python3 - "$out" "$(tree_commit)" "$command_line" "$backend" <<'EOF' | tee -a "$out/summary.txt"
import json, os, sys
out, commit, command, backend = sys.argv[1:]
path = os.path.join(out, "vllm_replay_mla_flashinfer_bg_dense.json")
verdict = {"command": command, "tree": commit, "gpu": open(os.path.join(out, "gpu.txt")).read().strip(),
           "mla_backend": backend}
if os.path.exists(path):
    r = json.load(open(path))
    d = r["decode_batch_ge_60"]
    verdict.update({k: r[k] for k in ("bitwise_equal", "mismatched_steps", "steps", "decode_steps", "num_blocks",
                                       "block_bytes", "page_bytes", "memory", "most_blocks_backed", "map_calls",
                                       "unmap_calls", "map_us_per_block", "unmap_us_per_block", "overhead_vs_fixed",
                                       "step_ms")},
                   decode_batch_60_64={"steps": d["steps"], "overhead_vs_fixed": d["overhead_vs_fixed"],
                                       "step_ms": {k: d["step_ms"][k] for k in ("vkv", "fixed", "map", "wait")},
                                       "per_step_overhead": d["per_step_overhead"]},
                   replay_json=os.path.basename(path), provenance=r.get("provenance"), machine=r.get("machine"))
else:
    verdict["bitwise_equal"] = None
json.dump(verdict, open(os.path.join(out, "vllm_mla_replay.json"), "w"), indent=1)
print(f"mla: verdict in {os.path.join(out, 'vllm_mla_replay.json')} (bitwise equal: {verdict['bitwise_equal']})")
EOF
exit $status
