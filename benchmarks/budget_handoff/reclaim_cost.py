"""What handing N bytes from an idle member of a shared budget to an asker costs, and where
the time goes. Two member processes share a budget of exactly N bytes. The holder maps N
bytes for one request, frees it and makes no call after that, the way an idle engine
does: the request's zero-fill is still deferred. Then the asker maps N bytes in one
step(), so every page moves. Each round splits the time into

  readers  the holder waiting for the last device work on those pages (answer_event_wait)
  unmap    unmapping them (choosing victims included)
  release  releasing them to the device (cuMemRelease)
  count    counting them back to the budget (its lock, waking the asker)
  answer   the holder's whole answer (the above, its lock wait and the pledge)
  ask      the asker's wait for the pages, end to end (budget_asks)
  step     the asker's whole step(): the ask, then creating and mapping its own pages

with p50/p99 over the rounds, for 2 MiB pages and for large pages (--large-page-size,
128 MiB by default: one cuMemRelease each). Between rounds the asker frees its request and
trims, so that the holder creates its pages anew (large ones when asked for).

  python -m benchmarks.budget_handoff.reclaim_cost                                   # host backend, numbers meaningless
  python -m benchmarks.budget_handoff.reclaim_cost --device cuda --out benchmarks/budget_handoff/results
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import uuid

import numpy as np


from benchmarks.common import device_tag, machine, percentiles, write_json

MiB = 1 << 20
PARTS = ("readers", "unmap", "release", "count", "answer", "ask", "step")


def member(name: str, device: str, tokens: int, large_page_size: int, connection) -> None:
    try:
        serve(name, device, tokens, large_page_size, connection)
    except Exception:  # noqa: BLE001 (the parent reports it)
        import traceback

        connection.send(("error", traceback.format_exc()))


def serve(name: str, device: str, tokens: int, large_page_size: int, connection) -> None:
    import torch
    import vkv

    # Llama-3-8B's shape, all layers in one region: 128 KiB a token, 16 tokens a 2 MiB page.
    cache = vkv.KVCache(32, 8, 128, torch.bfloat16 if device != "cpu" else torch.float16, max_batch_size=2,
                        max_context_len=tokens, device=device, shared_budget=name, layout="interleaved",
                        background_mapping=False, large_page_size=large_page_size)
    lens = np.zeros(cache.max_batch_size, dtype=np.int64)
    slot = None

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    connection.send(("ready", cache.page_size))
    last = cache.stats()["budget_handoff"]
    while True:
        command = connection.recv()
        if command == "exit":
            cache.close()
            connection.send(("done", None))
            return
        if command == "answered":  # what its watcher did since the last look: the other's ask
            time.sleep(0.05)  # the answer's own bookkeeping ends after the asker goes on
            now = cache.stats()["budget_handoff"]
            connection.send(("ok", {key: now[key] - last[key] for key in now}))
            last = now
            continue
        before = cache.stats()
        began = time.perf_counter()
        if command == "take":  # maps `tokens` in one step(): the asker asks the other for them
            slot = cache.alloc_reqid()
            lens[:] = 0
            lens[slot] = tokens
            cache.step(lens)
            sync()
        elif command == "leave":  # the request ends and the member goes idle: its fill stays deferred
            cache.free_reqid(slot)
            sync()
        elif command == "release":  # the asker gives everything back to the device for the next round
            cache.free_reqid(slot)
            cache.trim()
            sync()
        took = time.perf_counter() - began
        after = cache.stats()
        last = after["budget_handoff"]
        connection.send(("ok", {"step_seconds": took,
                                "ask_seconds": after["budget_asks"]["seconds"] - before["budget_asks"]["seconds"],
                                "asks": after["budget_asks"]["calls"] - before["budget_asks"]["calls"],
                                "large_pages": after["large_pages"]}))


def measure(device: str, size: int, large_page_size: int, rounds: int) -> dict:
    import vkv

    context = multiprocessing.get_context("spawn")
    name = f"vkv-reclaim-cost-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    budget = vkv.SharedBudget.create(name, size, device=device)
    ends, processes = [], []
    tokens = 0
    try:
        def receive(index):
            if not ends[index].poll(300):
                raise RuntimeError(f"member {index} sent nothing within 300 s")
            kind, payload = ends[index].recv()
            if kind == "error":
                raise RuntimeError(f"member {index} failed:\n{payload}")
            return payload

        page_bytes = 0
        for index in range(2):
            parent, child = context.Pipe()
            ends.append(parent)
            # Tokens of N bytes: 128 KiB each (32 layers, 8 KV heads of 128, 2 bytes, K and V).
            tokens = size // (32 * 2 * 8 * 128 * 2)
            process = context.Process(target=member, args=(name, device, tokens, large_page_size, child), daemon=True)
            process.start()
            processes.append(process)
            page_bytes = receive(index)

        def call(index, command):
            ends[index].send(command)
            return receive(index)

        holder, asker = 0, 1
        rows = []
        for round_index in range(rounds + 1):  # the first warms up
            taken = call(holder, "take")
            call(holder, "leave")
            asked = call(asker, "take")
            answered = call(holder, "answered")
            call(asker, "release")
            if round_index == 0:
                continue
            rows.append({
                "pages": answered["answer_pages"], "answers": answered["answers"], "asks": asked["asks"],
                "holder_large_pages": taken["large_pages"],
                "readers": answered["answer_event_wait_seconds"], "unmap": answered["answer_unmap_seconds"],
                "release": answered["answer_release_seconds"], "count": answered["answer_count_seconds"],
                "answer": answered["answer_seconds"], "lock_wait": answered["answer_lock_wait_seconds"],
                "ask": asked["ask_seconds"], "step": asked["step_seconds"]})
    finally:
        for end in ends:
            try:
                end.send("exit")
                if end.poll(60):
                    end.recv()
            except (EOFError, OSError):
                pass
        for process in processes:
            process.join(60)
        budget.remove()
    ms = {part: percentiles([row[part] * 1e3 for row in rows]) for part in PARTS}
    return {"bytes": size, "page_bytes": page_bytes, "large_page_size": large_page_size,
            "pages_moved_p50": float(np.median([row["pages"] for row in rows])),
            "holder_large_pages_p50": float(np.median([row["holder_large_pages"] for row in rows])),
            "ms": ms, "rounds": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (the host backend) or cuda")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=None,
                        help="bytes handed over per round, in MiB (default 256 1024 4096 on a GPU, 128 256 on the host)")
    parser.add_argument("--large-page-size-mib", type=int, default=128,
                        help="the large pages' size; 0 measures 2 MiB pages only")
    parser.add_argument("--rounds", type=int, default=None, help="per size and page kind (default 30; host 5)")
    parser.add_argument("--out", default=None, help="folder for reclaim_cost_<gpu>.json")
    args = parser.parse_args(argv)
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    sizes = args.sizes_mib or ([128, 256] if device == "cpu" else [256, 1024, 4096])
    rounds = args.rounds or (5 if device == "cpu" else 30)
    kinds = [0] + ([args.large_page_size_mib * MiB] if args.large_page_size_mib else [])
    results = []
    print(f"{'pages':>6} {'MiB':>5} | p50 / p99 ms: " + "  ".join(f"{part:>13}" for part in PARTS))
    for large in kinds:
        for size_mib in sizes:
            result = measure(device, size_mib * MiB, large, rounds)
            results.append(result)
            kind = "2 MiB" if large == 0 else f"{large // MiB} MiB"
            cells = "  ".join(f"{result['ms'][part]['p50']:6.2f}/{result['ms'][part]['p99']:6.2f}" for part in PARTS)
            print(f"{kind:>6} {size_mib:5d} | {cells}   ({result['pages_moved_p50']:.0f} pages moved, holder had "
                  f"{result['holder_large_pages_p50']:.0f} large pages)", flush=True)
    if args.out:
        write_json({"machine": machine(device), "rounds": rounds, "parts": {
            "readers": "the holder's wait for the last device work on the pages",
            "unmap": "unmapping them", "release": "releasing them to the device",
            "count": "counting them back to the budget", "answer": "the holder's whole answer",
            "ask": "the asker's wait for the pages", "step": "the asker's whole step()"}, "results": results},
            os.path.join(args.out, f"reclaim_cost_{device_tag(device)}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
