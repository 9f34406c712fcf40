"""Logs, in every SGLang scheduler process this directory is on the PYTHONPATH of, the pages
vkv backs for it whenever they change: after each scheduler iteration's choice of batch
(``Scheduler.get_next_batch_to_run``) and each idle pass (``Scheduler.on_idle``), through
SGLang's HookRegistry, a line "<iteration> <backed page ids>" appended to ``tp<rank>`` in
the folder VKV_LOG_SGLANG_BACKING names (the iteration: vkv's count of the scheduler's
reports). Active only where that variable is set. Tensor-parallel ranks run the same
iterations, so their logs must be equal (test_sglang_tp_engine.py)."""

import os

if os.environ.get("VKV_LOG_SGLANG_BACKING"):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _last = {}

    def _log(result, scheduler, *args, **kwargs):  # type: ignore[no-untyped-def]
        import numpy as np
        from sglang.srt.runtime_context import get_parallel

        allocator = scheduler.token_to_kv_pool_allocator
        backing = getattr(allocator, "backing", None)
        if backing is None or backing.closed:
            return None
        backed = " ".join(map(str, np.flatnonzero(np.asarray(backing.states)).tolist()))
        if _last.get("backed") != backed:
            _last["backed"] = backed
            path = os.path.join(os.environ["VKV_LOG_SGLANG_BACKING"], f"tp{get_parallel().tp_rank}")
            with open(path, "a") as out:
                out.write(f"{allocator.iteration} {backed}\n")
        return None

    for _method in ("get_next_batch_to_run", "on_idle"):
        HookRegistry.register(f"sglang.srt.managers.scheduler.Scheduler.{_method}", _log, HookType.AFTER)
