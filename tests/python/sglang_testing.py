"""A tiny SGLang 0.5.23 engine on a CPU for the vkv.integrations.sglang tests: SGLang's own
``sglang.Engine`` (its launcher, scheduler process, radix cache, allocator, overlap loop,
leak checks made strict), started the way a user starts it, with vkv switched on by
VKV_SGLANG_BUDGET and loaded through the ``sglang.srt.plugins`` entry point, over a 2-layer
Llama with random weights (``load_format="dummy"``, a fixed seed) on SGLang's CPU platform
with its torch-native attention. Nothing of SGLang is replaced but sglang-kernel's CPU
build (sglang_stubs/: names SGLang imports and never calls here).

Each engine runs in a process of its own (``run()``: sglang_engine_run.py with a JSON spec),
so that its environment is its own and nothing of it outlives the test.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
STUBS = HERE / "sglang_stubs"
DRIVER = HERE / "sglang_engine_run.py"
LAYERS, HEADS, KV_HEADS, HIDDEN = 2, 4, 2, 64  # head_dim 16, float32: 512 bytes a token over both layers' K and V
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * (HIDDEN // HEADS) * 4
PAGE = 16


def model_dir(root: Path) -> Path:
    path = root / "tiny-llama"
    path.mkdir(exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": 2 * HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": LAYERS, "vocab_size": 512, "max_position_embeddings": 4096,
              "torch_dtype": "float32", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    return path


def workload() -> List[List[Dict[str, Any]]]:
    """Two rounds sent one after the other: 8 requests of 4 families of prompts sharing a
    48-token prefix (radix hits within the round), then 4 more of the same families (hits on
    what the first round left cached); prompts of 56-72 tokens (chunked prefill at 64) and
    48-72 new tokens each: more than the pool holds at once (queueing, and retraction where
    admission was optimistic).
    Greedy sampling: the outputs depend on the KV alone. (Not ignore_eos: SGLang's admission
    then reserves every request's whole max_new_tokens, and never retracts.)"""
    out = []
    for r, count in enumerate((8, 4)):
        batch = []
        for i in range(count):
            family = i % 4
            prefix = [(7 * family + 3 * k) % 500 + 3 for k in range(48)]
            suffix = [(11 * i + 5 * k + r) % 500 + 3 for k in range(8 + 8 * (i % 3))]
            batch.append({"input_ids": prefix + suffix, "max_new_tokens": 48 + 8 * (i % 4)})
        out.append(batch)
    return out


def environment(budget: Optional[str] = None, **extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VKV_SGLANG_")}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join([str(STUBS), env.get("PYTHONPATH", "")]),
                "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
                "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    if budget:
        env["VKV_SGLANG_BUDGET"] = budget
    env.update(extra)
    return env


def run(spec: Dict[str, Any], env: Dict[str, str], timeout: float = 1500) -> Dict[str, Any]:
    """Runs one engine over ``spec`` (see sglang_engine_run.py) in its own process; returns its
    JSON result, or {"error": <its last stderr lines>, "returncode": N} when it failed."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, model=str(model_dir(Path(tmp))), result=str(Path(tmp) / "result.json"))
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, str(DRIVER), str(spec_path)], env=env, capture_output=True, text=True,
                              timeout=timeout)
        result_path = Path(spec["result"])
        if proc.returncode == 0 and result_path.exists():
            return json.loads(result_path.read_text())
        return {"error": "\n".join(proc.stderr.strip().splitlines()[-30:]), "returncode": proc.returncode}
