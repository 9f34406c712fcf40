"""A member of a shared budget in a process of its own, driven by the tests over pipes.

    python budget_member.py NAME [--mapper] [--floor BYTES] [--cap BYTES] [--priority N] [--label TEXT]

Reads one JSON command per line on stdin and answers one JSON line on stdout:
  {"op": "alloc"}                       -> {"slot": s}
  {"op": "step", "lens": {s: tokens}}   -> {"ok": true} or {"error": "OutOfMemory", "missing_pages": n}
  {"op": "free", "slot": s}             -> {"ok": true}
  {"op": "write", "slot": s, "tokens": n, "value": v} / {"op": "check", ...} -> {"ok": bool}
  {"op": "churn", "iterations": n}      -> alloc/step/free in a loop, preempting on a shortage:
                                           {"iterations": n, "shortages": k, "errors": [...]}
  {"op": "stats"}                       -> the cache's stats()
  {"op": "exit"}
Not a test itself (no test_ prefix).
"""

import json
import os
import sys

import torch

import vkv

TOKENS_PER_PAGE = 32  # 4 layers, 2 KV heads of 64, fp16, interleaved: 2 KiB a token, 64 KiB pages


# Options that name a KVCache keyword: --floor -> shared_budget_floor, and so on.
LIMITS = {"--floor": ("shared_budget_floor", int), "--cap": ("shared_budget_cap", int),
          "--priority": ("shared_budget_priority", int), "--label": ("shared_budget_label", str)}


def limits(argv):
    options = {}
    for flag, (keyword, kind) in LIMITS.items():
        if flag in argv:
            options[keyword] = kind(argv[argv.index(flag) + 1])
    return options


def make_cache(name, mapper, **options):
    return vkv.KVCache(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                       max_context_len=4096, device="cpu", page_size=64 << 10, background_mapping=mapper,
                       shared_budget=name, **options)


def step(cache, lengths):
    seq_lens = [0] * cache.max_batch_size
    for slot, tokens in lengths.items():
        seq_lens[int(slot)] = tokens
    cache.step(seq_lens)


def churn(cache, iterations):
    """A busy engine: requests of 1-8 pages arrive, grow a token an iteration and leave; a
    shortage preempts the largest."""
    shortages, errors, live = 0, [], {}
    for i in range(iterations):
        try:
            if len(live) < cache.max_batch_size:
                live[cache.alloc_reqid()] = (1 + 7 * i % 8) * TOKENS_PER_PAGE
            live = {slot: tokens + 1 for slot, tokens in live.items()}
            step(cache, live)
            cache.check_invariants()
            if i % 3 == 2:
                cache.free_reqid(live.popitem()[0])
        except vkv.OutOfMemory:
            shortages += 1
            victim = max(live, key=live.get)
            del live[victim]
            cache.free_reqid(victim)
        except Exception as error:  # noqa: BLE001 (reported to the test)
            errors.append(f"{type(error).__name__}: {error}")
    for slot in live:
        cache.free_reqid(slot)
    return {"iterations": iterations, "shortages": shortages, "errors": errors}


def answer(cache, command):
    op = command["op"]
    if op == "alloc":
        return {"slot": cache.alloc_reqid()}
    if op == "step":
        try:
            step(cache, command["lens"])
        except vkv.OutOfMemory as error:
            return {"error": "OutOfMemory", "missing_pages": error.missing_pages}
        return {"ok": True}
    if op == "free":
        cache.free_reqid(command["slot"])
        return {"ok": True}
    if op in ("write", "check"):
        keys = cache.key(0)[command["slot"], : command["tokens"]]
        if op == "write":
            keys.fill_(command["value"])
            return {"ok": True}
        return {"ok": bool((keys == command["value"]).all())}
    if op == "churn":
        return churn(cache, command["iterations"])
    if op == "stats":
        stats = cache.stats()
        return {key: value for key, value in stats.items() if isinstance(value, int)}
    raise ValueError(f"unknown op {op!r}")


def main():
    cache = make_cache(sys.argv[1], mapper="--mapper" in sys.argv, **limits(sys.argv))
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        print(json.dumps(answer(cache, command)), flush=True)
    cache.close()


if __name__ == "__main__":
    main()
