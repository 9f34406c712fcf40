"""Every KV store the lab's harnesses take, by name: ``make_store("vkv-interleaved", ...)``.

The stores live in ``kv_stores`` (the interface, vkv, static, FlexAttention's paged cache) and
``flashinfer`` (FlashInfer's paged kernels, on their pages or on vkv's memory); this module,
above both, is the one that knows them all.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from .flashinfer import FlashInferStore, VkvFlashInferStore
from .kv_stores import KvStore, PagedStore, StaticStore, VkvStore


def make_store(kind: str, model_shape, dtype: torch.dtype, device: torch.device, max_context: int,
               budget_bytes: int, max_slots: int, flex: Callable, page_size: int = 0, large_page_size: int = 0,
               ready: float = 0.0, ready_slot_tokens: int = 0) -> KvStore:
    """kind: vkv-interleaved, vkv-per-layer, paged-<tokens>, flashinfer-<tokens>, static, and
    vkv-interleaved-fi, vkv-per-layer-fi (vkv's memory with FlashInfer's kernels, one page
    per request; -fi-<tokens>: the slots cut into pages of that many tokens).
    ``large_page_size``, ``ready`` and ``ready_slot_tokens`` go to the vkv stores (VkvStore).

    @throws StoreUnavailable where a flashinfer store cannot run (no GPU, no FlashInfer)."""
    common = (model_shape.num_layers, model_shape.num_kv_heads, model_shape.head_dim, dtype, device, max_context)
    vkv_flashinfer = re.fullmatch(r"vkv-(interleaved|per-layer)-fi(?:-([1-9][0-9]*))?", kind)
    if vkv_flashinfer:
        layout, page_tokens = vkv_flashinfer.groups()
        return VkvFlashInferStore(*common, budget_bytes, max_slots, layout.replace("-", "_"), model_shape.num_heads,
                                  int(page_tokens or 0), page_size, large_page_size=large_page_size, ready=ready,
                                  ready_slot_tokens=ready_slot_tokens)
    if kind.startswith("vkv-"):
        return VkvStore(*common, budget_bytes, max_slots, kind[4:].replace("-", "_"), page_size,
                        large_page_size=large_page_size, ready=ready, ready_slot_tokens=ready_slot_tokens)
    if kind.startswith("paged-"):
        return PagedStore(*common, budget_bytes, max_slots, int(kind[6:]), flex)
    if kind.startswith("flashinfer-"):
        return FlashInferStore(*common, budget_bytes, max_slots, int(kind[11:]), model_shape.num_heads)
    if kind == "static":
        return StaticStore(*common, budget_bytes)
    raise ValueError(f"store = {kind!r} is not one of vkv-interleaved, vkv-per-layer, paged-<tokens>, "
                     f"flashinfer-<tokens>, static, vkv-interleaved-fi[-<tokens>], vkv-per-layer-fi[-<tokens>]")


__all__ = ["make_store"]
