#!/usr/bin/env bash
# The MLA half of scripts/gpu/vllm_replay.sh: vLLM's recorded block decisions for
# DeepSeek-V2-Lite's MLA cache (27 layers of one 576-wide latent, 32-token blocks straddling
# 2 MiB pages) replayed over vkv.BlockBacking and a fixed pool with FlashInfer's MLA kernel,
# eager and from CUDA graphs (one GPU; ~4 minutes with vkv's build and FlashInfer's MLA module).
#   scripts/gpu/vllm_mla_replay.sh OUT   results as vllm_replay.sh's: OUT/summary.txt,
#                                        OUT/vllm_replay_mla.json, OUT/logs.tar.gz
VLLM_REPLAY_PARTS=mla exec "$(dirname "$0")/vllm_replay.sh" "$@"
