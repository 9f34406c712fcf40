"""vkv inside SGLang 0.5.23 through SGLang's own plugin seams (docs/sglang.md).

Installing vkv registers ``plugin`` under SGLang's ``sglang.srt.plugins`` entry-point group;
SGLang calls it in its launcher, schedulers, detokenizer and DP controller. It does nothing
unless ``VKV_SGLANG_BUDGET`` names a vkv shared budget (settings.py); then it registers the
hooks of hooks.py, and SGLang's scheduler builds vkv's pool (pool.py) and allocator
(allocator.py). ``import vkv`` does not import this package, nor this package SGLang.
"""

import os


def plugin() -> None:
    """SGLang's entry point (group ``sglang.srt.plugins``, name ``vkv``)."""
    if not os.environ.get("VKV_SGLANG_BUDGET", "").strip():
        return
    from . import hooks

    hooks.register()
