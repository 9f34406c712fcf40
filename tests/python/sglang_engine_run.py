"""One SGLang engine for sglang_testing.run(): reads a JSON spec, starts ``sglang.Engine`` on
the CPU, sends the spec's rounds of requests, waits (with a bound) until a vkv engine has
given back its free memory, and writes the outputs and what the shared budget saw."""

import json
import sys
import time


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    import sglang

    engine = sglang.Engine(model_path=spec["model"], device="cpu", load_format="dummy", skip_tokenizer_init=True,
                           dtype="float32", attention_backend="torch_native", grammar_backend="none",
                           disable_cuda_graph=True, random_seed=1234, log_level="warning",
                           mem_fraction_static=0.05, **spec["server_args"])
    result = {"rounds": [], "budget": []}
    try:
        for batch in spec["rounds"]:
            outputs = engine.generate(input_ids=[r["input_ids"] for r in batch],
                                      sampling_params=[{"temperature": 0.0, "max_new_tokens": r["max_new_tokens"],
                                                        "ignore_eos": True} for r in batch])
            result["rounds"].append([{"output_ids": o["output_ids"],
                                      "cached_tokens": o["meta_info"].get("cached_tokens", 0),
                                      "retractions": o["meta_info"].get("num_retractions", 0)} for o in outputs])
            if spec.get("budget"):
                result["budget"].append(_idle_members(spec["budget"], spec.get("idle_bytes", 0)))
    finally:
        engine.shutdown()
    json.dump(result, open(spec["result"], "w"))


def _idle_members(name: str, idle_bytes: int, bound_s: float = 60.0) -> list:
    """The budget's members once every one holds at most ``idle_bytes`` (an idle engine gives
    back its free pages), or after ``bound_s`` seconds."""
    import vkv

    budget = vkv.SharedBudget.open(name)
    deadline = time.monotonic() + bound_s
    while True:
        members = budget.stats()["members"]
        if all(m["bytes_held"] <= idle_bytes for m in members) or time.monotonic() > deadline:
            return members
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1])
