"""SGLang's own KV pools with their buffers in a vkv reservation.

The platform's ``get_kv_pool_cls(kind)`` hands SGLang these subclasses (hooks.py). Only
``_create_buffers`` changes, as SGLang's platform interface intends: the tensors keep the
shapes, strides and dtypes SGLang gives them (layout.py), so every in-tree kernel, HiCache
and the PD transfer paths see ordinary tensors; which of their pages have memory behind
them is the allocator's business (allocator.py), through the pool's ``vkv_backing``.
"""

import os
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from .layout import PoolLayout, mha_layout, mla_layout, views
from .settings import Settings

_HOST_PAGE_BYTES = 4096
_CUDA_PAGE_BYTES = 2 << 20
AGREEMENT_TIMEOUT_S = 600


def _device(device: Any) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    if device.type == "cpu":
        return "cpu"
    raise ValueError(f"vkv.integrations.sglang: device {device} is not supported (cuda or cpu); "
                     "unset VKV_SGLANG_BUDGET to run SGLang's own pool")


def _parallel(name: str, default: int) -> int:
    """A rank or width from SGLang's parallel context; ``default`` where it has none."""
    try:
        from sglang.srt.runtime_context import get_parallel
        value = getattr(get_parallel(), name)
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return default
    return default if value is None else int(value)


def _ranks() -> tuple:
    """(rank, ranks, engine tag, tp_rank, tp_size) of this scheduler among the engine's
    tensor- and pipeline-parallel ranks."""
    tp_rank, tp_size = _parallel("tp_rank", 0), _parallel("tp_size", 1)
    pp_rank, pp_size = _parallel("pp_rank", 0), _parallel("pp_size", 1)
    # The ranks of one engine are the launcher's children: its pid tells engines apart.
    return pp_rank * tp_size + tp_rank, tp_size * pp_size, f"{os.getppid()}-{_parallel('attn_dp_rank', 0)}", \
        tp_rank, tp_size


def refuse_page_size_one(page_size: int) -> None:
    if page_size <= 1:
        raise ValueError("vkv.integrations.sglang: --page-size 1 (SGLang's default) uses SGLang's token allocator, "
                         "which vkv cannot back; start SGLang with --page-size 16 (or unset VKV_SGLANG_BUDGET)")


class _VkvBuffers:
    """What both pools share: the reservation, its backing, and the tensors cut from it."""

    vkv_backing: Any = None
    vkv_layout: Optional[PoolLayout] = None
    vkv_settings: Optional[Settings] = None
    vkv_budget: str = ""  # the shared budget's name on this rank's device
    vkv_floor: int = 0  # VKV_SGLANG_FLOOR as the budget keeps it (PoolLayout.held_floor)
    device: Any  # SGLang's pool sets it

    def _vkv_make_backing(self, layout: PoolLayout) -> torch.Tensor:
        import vkv

        settings = Settings.from_environment()
        if settings is None:
            raise RuntimeError("vkv.integrations.sglang: the vkv pool was built without VKV_SGLANG_BUDGET")
        rank, ranks, engine, tp_rank, tp_size = _ranks()
        agreement = (f"vkv-sglang-{engine}", rank, ranks, AGREEMENT_TIMEOUT_S) if ranks > 1 else None
        device = _device(self.device)
        self.vkv_settings, self.vkv_layout, self.vkv_budget = settings, layout, settings.budget_on(device)
        self.vkv_floor = layout.held_floor(settings.floor, self._vkv_page_bytes())
        self.vkv_backing = vkv.BlockBacking(
            layout.num_blocks, ranges=layout.ranges(), reserved_bytes=layout.reserved_bytes,
            device=device, shared_budget=self.vkv_budget,
            shared_budget_floor=self.vkv_floor,
            shared_budget_cap=settings.cap,
            shared_budget_priority=settings.priority,
            shared_budget_label=settings.member_label(tp_rank, tp_size),
            page_size=self._vkv_page_bytes(), permanent_blocks=(0,), agreement=agreement)
        return self.vkv_backing.tensor()

    def _vkv_page_bytes(self) -> int:
        return _CUDA_PAGE_BYTES if torch.device(self.device).type == "cuda" else _HOST_PAGE_BYTES

    def _vkv_close(self) -> None:
        if self.vkv_backing is not None:
            self.vkv_backing.close()
            self.vkv_backing = None


class VkvMHATokenToKVPool(_VkvBuffers, MHATokenToKVPool):
    """SGLang's MHA pool (NHD layout, unquantized KV, any KV dtype) over vkv memory."""

    def _create_buffers(self) -> None:
        refuse_page_size_one(self.page_size)
        if self.is_quantized_kv_cache or self.post_capture_active or self.kv_cache_layout != "nhd":
            what = ("a quantized KV cache" if self.is_quantized_kv_cache else "post-capture KV backing"
                    if self.post_capture_active else f"the {self.kv_cache_layout!r} KV layout")
            raise ValueError(f"vkv.integrations.sglang: {what} is not supported; use SGLang's default KV layout "
                             "and cache (or unset VKV_SGLANG_BUDGET)")
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        layout = mha_layout(size=self.size, page_size=self.page_size, layers=self.layer_num, heads=self.head_num,
                            head_dim=self.head_dim, v_head_dim=self.v_head_dim, itemsize=self.store_dtype.itemsize,
                            vkv_page_bytes=self._vkv_page_bytes())
        tensors = views(self._vkv_make_backing(layout), layout, self.store_dtype)
        self.k_buffer, self.v_buffer = tensors[0::2], tensors[1::2]
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    def _clear_buffers(self) -> None:
        super()._clear_buffers()
        self._vkv_close()


class VkvMLATokenToKVPool(_VkvBuffers, MLATokenToKVPool):
    """SGLang's MLA pool (one latent vector per token and layer) over vkv memory."""

    def _create_buffers(self) -> None:
        refuse_page_size_one(self.page_size)
        layout = mla_layout(size=self.size, page_size=self.page_size, layers=self.layer_num,
                            kv_cache_dim=self.kv_cache_dim, itemsize=self.store_dtype.itemsize,
                            vkv_page_bytes=self._vkv_page_bytes())
        self.kv_buffer = views(self._vkv_make_backing(layout), layout, self.store_dtype)

    def _clear_buffers(self) -> None:
        super()._clear_buffers()
        self._vkv_close()


POOL_CLASSES = {"mha": VkvMHATokenToKVPool, "mla": VkvMLATokenToKVPool}
