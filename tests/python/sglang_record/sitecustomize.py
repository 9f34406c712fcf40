"""Records, in every SGLang process this directory is on the PYTHONPATH of, the KV decisions
of SGLang's scheduler for benchmarks/sglang_replay/sglang_replay.py: once per forward (before
``Scheduler.run_batch``, through SGLang's HookRegistry), whether it decodes or extends, each
request's token slots and how many of them the forward writes, and the pages vkv backs.
Active only where VKV_RECORD_SGLANG_STEPS names the JSON-lines file to append to."""

import json
import os

if os.environ.get("VKV_RECORD_SGLANG_STEPS"):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _record(scheduler, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        import numpy as np

        allocator = scheduler.token_to_kv_pool_allocator
        backing = getattr(allocator, "backing", None)
        table = scheduler.req_to_token_pool.req_to_token
        decode = bool(batch.forward_mode.is_decode())
        seq_lens = batch.seq_lens_cpu.tolist()
        new = [1] * len(seq_lens) if decode else list(batch.extend_lens)
        requests = [{"slots": table[int(row), :length].tolist(), "new": int(n)}
                    for row, length, n in zip(batch.req_pool_indices.tolist(), seq_lens, new)]
        step = {"decode": decode, "requests": requests, "page_size": allocator.page_size,
                "num_pages": allocator.num_pages,
                "backed": None if backing is None else np.flatnonzero(np.asarray(backing.states)).tolist()}
        with open(os.environ["VKV_RECORD_SGLANG_STEPS"], "a") as out:
            out.write(json.dumps(step) + "\n")

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.run_batch", _record, HookType.BEFORE)
