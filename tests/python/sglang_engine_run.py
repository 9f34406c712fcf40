"""One SGLang engine for sglang_testing.run(): reads a JSON spec, starts ``sglang.Engine`` on
the CPU, sends the spec's rounds of requests, waits (with a bound) until a vkv engine has
given back its free memory (with ``flush``: after SGLang's flush_cache(), which turns the
radix cache's pages into free ones), and writes the outputs and what the shared budget saw.

With ``signals`` (a folder), another test drives it: before round N > 0 (and before round 0
too with ``wait_first``) it waits for the file ``go-N``; after round N it writes ``round-N`` (JSON: the most its scheduler held in the
budget during the round, and that scheduler's pid); after the last round it waits for
``stop`` (or a kill)."""

import json
import os
import sys
import threading
import time


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    import sglang

    engine = sglang.Engine(model_path=spec["model"], device="cpu", load_format="dummy", skip_tokenizer_init=True,
                           dtype="float32", attention_backend="torch_native", grammar_backend="none",
                           disable_cuda_graph=True, random_seed=1234, log_level="warning",
                           mem_fraction_static=0.9, **spec["server_args"])  # the pool: max_total_tokens
    result = {"rounds": [], "budget": []}
    signals = spec.get("signals")
    try:
        for index, batch in enumerate(spec["rounds"]):
            if signals and (index or spec.get("wait_first")):
                _wait_for(os.path.join(signals, f"go-{index}"))
            watch = _Watch(spec["budget"], os.getpid()) if signals else None
            outputs = engine.generate(input_ids=[r["input_ids"] for r in batch],
                                      sampling_params=[{"temperature": 0.0, "max_new_tokens": r["max_new_tokens"]}
                                                       for r in batch])
            result["rounds"].append([{"output_ids": o["output_ids"],
                                      "cached_tokens": o["meta_info"].get("cached_tokens", 0),
                                      "retractions": o["meta_info"].get("num_retractions", 0)} for o in outputs])
            if watch is not None:
                most, pid = watch.stop()
                with open(os.path.join(signals, f"round-{index}"), "w") as out:
                    json.dump({"most_held": most, "scheduler_pid": pid}, out)
            elif spec.get("budget"):
                if spec.get("flush"):  # SGLang's own flush: the radix cache's pages become free ones
                    assert engine.flush_cache().success
                result["budget"].append(_idle_members(spec["budget"], spec.get("idle_bytes", 0)))
        if signals:
            _wait_for(os.path.join(signals, "stop"))
    finally:
        engine.shutdown()
    json.dump(result, open(spec["result"], "w"))


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


class _Watch(threading.Thread):
    """The most the engine's scheduler (the budget's member that is a child of this
    process) held while a round ran, and its pid."""

    def __init__(self, name: str, launcher: int) -> None:
        import vkv

        super().__init__(daemon=True)
        self.budget, self.launcher, self.most, self.pid = vkv.SharedBudget.open(name), launcher, 0, 0
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.02):
            for member in self.budget.stats()["members"]:
                if _parent(member["pid"]) == self.launcher:
                    self.pid, self.most = member["pid"], max(self.most, member["bytes_held"])

    def stop(self) -> tuple:
        self.done.set()
        self.join()
        return self.most, self.pid


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


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
