"""The SGLang seams vkv uses, registered with SGLang's ``HookRegistry`` by the plugin:

- ``SRTPlatform.apply_server_args_defaults`` (after SGLang's): checks the VKV_SGLANG_*
  settings and the budget, and the page size (no --page-size: 16; --page-size 1: refused);
- ``SRTPlatform.get_kv_pool_cls(kind)``: vkv's MHA and MLA pools (pool.py) where the
  platform has no pool of its own;
- ``SRTPlatform.get_paged_allocator_cls()``: vkv's allocator (allocator.py);
- ``Scheduler.get_next_batch_to_run`` (before) and ``Scheduler.on_idle`` (before): the
  engine's report to the shared budget, and its give-backs (sharing.py);
- ``SchedulerInvariantChecker._check_full_pool`` (around): SGLang's leak check stays on and
  counts the token slots vkv holds out as available, and says so in its message.
Each hook is a no-op for a pool or an allocator that is not vkv's.
"""

import dataclasses
import logging
from typing import Any

logger = logging.getLogger("vkv.integrations.sglang")

_PLATFORM = "sglang.srt.platforms.interface.SRTPlatform"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
DEFAULT_PAGE_SIZE = 16


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_PLATFORM}.apply_server_args_defaults", _server_args_defaults, HookType.AROUND)
    HookRegistry.register(f"{_PLATFORM}.get_kv_pool_cls", _kv_pool_cls, HookType.AROUND)
    HookRegistry.register(f"{_PLATFORM}.get_paged_allocator_cls", _paged_allocator_cls, HookType.AROUND)
    HookRegistry.register(f"{_SCHEDULER}.get_next_batch_to_run", _before_step, HookType.BEFORE)
    HookRegistry.register(f"{_SCHEDULER}.on_idle", _before_idle, HookType.BEFORE)
    HookRegistry.register(f"{_CHECKER}._check_full_pool", _check_full_pool, HookType.AROUND)


def _server_args_defaults(original: Any, platform: Any, server_args: Any) -> Any:
    result = original(platform, server_args)
    import vkv

    from .settings import Settings

    settings = Settings.from_environment()
    if settings is None:
        return result
    if "{device}" in settings.budget:  # each rank opens its GPU's in its scheduler
        return _page_size(server_args, result)
    try:
        vkv.SharedBudget.open(settings.budget).stats()
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"VKV_SGLANG_BUDGET={settings.budget!r}: {error} "
                         f"(create it first: python -m vkv.budget create {settings.budget} 40GiB)") from None
    return _page_size(server_args, result)


def _page_size(server_args: Any, result: Any) -> Any:
    page_size = getattr(server_args, "page_size", None)
    if page_size is None:
        server_args.page_size = DEFAULT_PAGE_SIZE
        logger.info("vkv: --page-size %d (vkv backs SGLang's paged allocator)", DEFAULT_PAGE_SIZE)
    else:
        from .pool import refuse_page_size_one
        refuse_page_size_one(int(page_size))
    return result


def _kv_pool_cls(original: Any, platform: Any, *, kind: str) -> Any:
    own = original(platform, kind=kind)
    if own is not None:
        return own
    from .pool import POOL_CLASSES
    return POOL_CLASSES.get(kind)


def _paged_allocator_cls(original: Any, platform: Any) -> Any:
    own = original(platform)
    if own is not None:
        return own
    from .allocator import VkvPagedTokenToKVPoolAllocator
    return VkvPagedTokenToKVPoolAllocator


def _speaker(scheduler: Any) -> Any:
    speaker = getattr(scheduler, "_vkv_speaker", None)
    if speaker is None:
        from .allocator import VkvPagedTokenToKVPoolAllocator
        from .sharing import BudgetSpeaker

        allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
        speaker = BudgetSpeaker(allocator, scheduler) if isinstance(allocator, VkvPagedTokenToKVPoolAllocator) else False
        scheduler._vkv_speaker = speaker
    return speaker


def _before_step(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    speaker = _speaker(scheduler)
    if speaker:
        speaker.step(idle=False)


def _before_idle(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    speaker = _speaker(scheduler)
    if speaker and scheduler.is_fully_idle():
        speaker.step(idle=True)


def _check_full_pool(original: Any, checker: Any, ps: Any, uncached: int = 0) -> Any:
    unbacked = getattr(checker.token_to_kv_pool_allocator, "unbacked_tokens", None)
    if unbacked is None:
        return original(checker, ps, uncached)
    held_out = unbacked()
    leak, message = original(checker, dataclasses.replace(ps, full_available_size=ps.full_available_size + held_out),
                             uncached)
    return leak, f"{message}, of which vkv holds out {held_out} (unbacked)"
