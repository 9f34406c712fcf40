"""What one ask costs: two members of a shared budget in two processes,
one holding N pages in freed requests (cached), the other asking for all N in one step().
The budget holds N pages, so every page moves. The roles swap every round. Per N: the
ask's wait (the asker's budget_asks) and the answer's time, split as
stats()['budget_handoff'] splits it (unmap / release to the device / count back to the
budget), per page.

  python -m benchmarks.budget_handoff.handoff_cost                          # host backend, ~20 s
  python -m benchmarks.budget_handoff.handoff_cost --device cuda --out benchmarks/budget_handoff/results
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import time
import uuid

import numpy as np


def member(name: str, device: str, pages: int, connection) -> None:
    try:
        serve(name, device, pages, connection)
    except Exception:  # noqa: BLE001 (the parent reports it)
        import traceback

        connection.send(("error", traceback.format_exc()))


def serve(name: str, device: str, pages: int, connection) -> None:
    import torch
    import vkv

    cache = vkv.KVCache(32, 8, 128, torch.bfloat16 if device != "cpu" else torch.float16, max_batch_size=4,
                        max_context_len=max(pages, 1) * 64, device=device, shared_budget=name, layout="interleaved",
                        background_mapping=False)
    per_page = cache.tokens_per_page
    slot = None
    lens = np.zeros(cache.max_batch_size, dtype=np.int64)

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    connection.send(("ready", per_page))
    last = cache.stats()["budget_handoff"]
    while True:
        command, count = connection.recv()
        if command == "exit":
            cache.close()
            connection.send(("done", None))
            return
        if command == "answered":  # what its watcher did since the last look: the other's ask
            time.sleep(0.02)  # the answer's own bookkeeping ends after the asker goes on
            now = cache.stats()["budget_handoff"]
            connection.send(("ok", {key: now[key] - last[key] for key in now}))
            last = now
            continue
        before = cache.stats()
        if command == "take":  # maps `count` pages in one step: asks the other for them
            slot = cache.alloc_reqid()
            lens[:] = 0
            lens[slot] = count * per_page
            cache.step(lens)
            sync()
        elif command == "free":  # its request ends: the pages stay cached, zero-filled by the next step
            cache.free_reqid(slot)
            lens[:] = 0
            cache.step(lens)
            sync()
        after = cache.stats()
        delta = {key: after["budget_handoff"][key] - before["budget_handoff"][key] for key in after["budget_handoff"]}
        delta["ask_seconds"] = after["budget_asks"]["seconds"] - before["budget_asks"]["seconds"]
        delta["asks"] = after["budget_asks"]["calls"] - before["budget_asks"]["calls"]
        last = after["budget_handoff"]
        connection.send(("ok", delta))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pages", type=int, nargs="+", default=None,
                        help="pages per ask (default: 32 128 512 on a GPU, 32 128 on the host: 2 MiB each)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.pages is None:
        args.pages = [32, 128] if args.device == "cpu" else [32, 128, 512]
    import torch
    import vkv

    context = multiprocessing.get_context("spawn")
    results = []
    for pages in args.pages:
        name = f"vkv-handoff-cost-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        probe = vkv.KVCache(32, 8, 128, torch.float16, max_batch_size=1, max_context_len=64, device=args.device)
        page_bytes = probe.page_size
        probe.close()
        budget = vkv.SharedBudget.create(name, pages * page_bytes, device=args.device)
        ends, processes = [], []
        try:
            for _ in range(2):
                parent, child = context.Pipe()
                process = context.Process(target=member, args=(name, args.device, pages, child), daemon=True)
                process.start()
                ends.append(parent)
                processes.append(process)
            def receive(index):
                if not ends[index].poll(120):
                    raise RuntimeError(f"member {index} sent nothing within 120 s")
                kind, payload = ends[index].recv()
                if kind == "error":
                    raise RuntimeError(f"member {index} failed:\n{payload}")
                return payload

            for index in range(2):
                receive(index)

            def call(index, command):
                ends[index].send((command, pages))
                return receive(index)

            call(0, "take")
            call(0, "free")
            rows = []
            holder = 0
            for _ in range(args.rounds):
                asker = 1 - holder
                began = time.perf_counter()
                asked = call(asker, "take")
                took = time.perf_counter() - began
                answered = call(holder, "answered")
                rows.append({"asker": asker, "step_s": took, **{f"asker_{k}": v for k, v in asked.items()},
                             **{f"answer_{k}": v for k, v in answered.items()}})
                call(asker, "free")
                holder = asker
        finally:
            for end in ends:
                try:
                    end.send(("exit", 0))
                    if end.poll(30):
                        end.recv()
                except (EOFError, OSError):
                    pass
            for process in processes:
                process.join(30)
            budget.remove()
        waits = np.array([r["asker_ask_seconds"] for r in rows]) * 1e3
        steps = np.array([r["step_s"] for r in rows]) * 1e3

        def per_page_us(key):  # the answers' time per page given, summed over the rounds
            given = sum(r["answer_answer_pages"] for r in rows)
            return sum(r.get(f"answer_{key}", 0.0) for r in rows) * 1e6 / max(1, given)  # older trees: no split

        split = {key: per_page_us(key) for key in ("answer_seconds", "answer_unmap_seconds", "answer_release_seconds",
                                                   "answer_count_seconds")}
        results.append({"pages": pages, "page_bytes": page_bytes, "rounds": rows,
                        "ask_wait_ms_p50": float(np.median(waits)), "ask_wait_ms_max": float(waits.max()),
                        "step_ms_p50": float(np.median(steps)), "answer_us_per_page": split})
        print(f"{pages:5d} pages: ask wait p50 {np.median(waits):7.2f} ms, max {waits.max():7.2f} ms; the asker's "
              f"step() p50 {np.median(steps):7.2f} ms; answering per page {split['answer_seconds']:.1f} us, of it "
              f"unmap {split['answer_unmap_seconds']:.1f} / release {split['answer_release_seconds']:.1f} / "
              f"count {split['answer_count_seconds']:.1f} us")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        machine = torch.cuda.get_device_name(0) if args.device != "cpu" else platform.machine()
        path = os.path.join(args.out, f"handoff_cost_{args.device.replace(':', '')}.json")
        with open(path, "w") as file:
            json.dump({"command": " ".join(["python benchmarks/budget_handoff/handoff_cost.py"] + (argv or sys.argv[1:])),
                       "machine": machine, "commit": os.environ.get("VKV_GIT_COMMIT"), "results": results}, file,
                      indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
