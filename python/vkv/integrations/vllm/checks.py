"""What VkvConnector refuses at startup: configurations it cannot serve, each one a one-line
ValueError naming the setting and what to change (docs/vllm.md, "Refused at startup").

Checked on vLLM's own config objects in the connector's ``__init__`` (scheduler and worker),
where vLLM 0.33 has resolved the KV cache layout (``KVCacheConfig.kv_cache_layout``,
``CacheConfig.kv_cache_layout``) and planned the KV buffer (``KVCacheTensor``). Imports
vllm (the connector's module does anyway).
"""

from typing import Optional

from .config import VkvConnectorConfig

# vLLM's KVCacheLayout names whose outermost dimension is the block: block b of every layer
# is one run of bytes, which vkv backs (as one slot, or page by page).
BLOCK_OUTERMOST = ("BLNHC", "BLHNC", "BHLNC")
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names (config/cache.py)
_WHAT_TO_DO_LAYOUT = ("set VLLM_KV_CACHE_LAYOUT=BLNHC (BLHNC for FlashInfer on Blackwell, SM100) with an attention "
                      "backend that accepts it (FLASH_ATTN, FLASHINFER; not FLEX_ATTENTION)")


def block_bytes(kv_cache_config) -> int:
    """One vLLM block over every layer and KV cache group, padding included: what vkv backs
    for each block (the KVCacheTensors' ``block_stride`` in a block-outermost layout)."""
    return kv_cache_config.kv_cache_tensors[0].block_stride


def page_bytes(settings: VkvConnectorConfig) -> int:
    """vkv's page for these settings: ``page_size``, else the device's (2 MiB GPU, 4 KiB host)."""
    from .slot_geometry import default_page_bytes
    return settings.page_size or default_page_bytes(settings.device)


def backed_bytes(blocks: int, block: int, page: int) -> int:
    """Bytes of pages ``blocks`` adjacent blocks of ``block`` bytes need at most: whole
    slots where a block is a power-of-two multiple of the page, else the pages they
    touch (partial pages at both ends)."""
    from .slot_geometry import one_slot_per_block
    if one_slot_per_block(block, page):
        return blocks * block
    return (-(-blocks * block // page) + 1) * page


def check_startup(vllm_config, kv_cache_config, settings: VkvConnectorConfig) -> None:
    """Every check below; raises the first failure's ValueError."""
    check_layout(vllm_config, kv_cache_config)
    check_kv_cache_config(kv_cache_config)
    check_budget(vllm_config, kv_cache_config, settings)


def _resolved_layout(vllm_config, kv_cache_config) -> "tuple[Optional[str], str]":
    """(the layout vLLM will use, where that comes from), or (None, '') while it is not known."""
    resolved = getattr(kv_cache_config, "kv_cache_layout", None) or vllm_config.cache_config.kv_cache_layout
    if resolved is not None:
        return resolved, f"vLLM's KV cache layout is {resolved}"
    import vllm.envs as envs
    requested = envs.VLLM_KV_CACHE_LAYOUT  # it wins over the connector's request (get_required_kvcache_layout)
    if requested is not None:
        return requested, f"VLLM_KV_CACHE_LAYOUT={requested}"
    return None, ""


def check_layout(vllm_config, kv_cache_config) -> None:
    """The layout vLLM really uses (the attention backend's or VLLM_KV_CACHE_LAYOUT's, which
    win over the connector's request) must be block-outermost."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    name, source = _resolved_layout(vllm_config, kv_cache_config)
    if name is None:
        return
    layout = KVCacheLayout.__members__.get(_ALIASES.get(name, name))
    if layout is not None and not layout.is_block_outermost:
        alias = f" (= {layout.name})" if layout.name != name else ""
        raise ValueError(
            f"VkvConnector: {source}{alias}, layer-outermost: a block's bytes lie in every layer's own region, "
            f"but vkv backs each block as one run of all its layers' bytes; {_WHAT_TO_DO_LAYOUT}")


def check_kv_cache_config(kv_cache_config) -> None:
    """Block b of every KV cache group and layer in the bytes ``[b * block_bytes, (b + 1) *
    block_bytes)`` of vLLM's one buffer: block-outermost strides. Any spec (full, sliding
    window, MLA, K and V of different sizes, Mamba state), any number of groups and padded
    pages qualify; host-resident groups (HiSparse) do not."""
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    if not groups or not tensors:
        raise ValueError("VkvConnector: the model has no KV cache (an attention-free model); there is nothing for "
                         "vkv to back: leave out --kv-transfer-config")
    hosted = [i for i, group in enumerate(groups) if getattr(group, "host_resident", False)]
    hosted += [i for i, tensor in enumerate(tensors) if getattr(tensor, "host_resident", False)]
    if hosted:
        raise ValueError("VkvConnector: KV cache groups in host memory (HiSparse) are not supported; turn HiSparse "
                         "off (attention_config.hisparse_config) to serve this model on vkv")
    num_blocks = kv_cache_config.num_blocks
    block = block_bytes(kv_cache_config)
    for tensor in tensors:
        layers = len(tensor.layers)
        if layers > 1 and tensor.block_stride < tensor.layer_stride:
            raise ValueError(
                f"VkvConnector: vLLM's KV cache tensor is layer-outermost (layer_stride {tensor.layer_stride} "
                f"bytes, block_stride {tensor.block_stride}), but vkv backs each block as one run of all its "
                f"layers' bytes; {_WHAT_TO_DO_LAYOUT}")
        end = tensor.offset + layers * min(tensor.layer_stride, block)
        if tensor.block_stride != block or tensor.size != num_blocks * block or end > block:
            raise ValueError(
                f"VkvConnector: vLLM's KV buffer is {tensor.size} bytes for {num_blocks} blocks, a tensor's blocks "
                f"{tensor.block_stride} bytes apart and its layers {tensor.offset}..{end} bytes into a block, but vkv "
                f"backs block b as the bytes [b * {block}, (b + 1) * {block}); {_WHAT_TO_DO_LAYOUT}")


def _blocks_of_one_request(vllm_config, kv_cache_config) -> int:
    """Blocks one request of max_model_len holds at most, over every KV cache group (vLLM's
    own per-layer estimate: a sliding window's or a Mamba state's blocks, not the length's)."""
    total = 0
    max_model_len = vllm_config.model_config.max_model_len
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        try:
            total += -(-spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)
        except (AttributeError, NotImplementedError, TypeError, ZeroDivisionError):
            total += -(-max_model_len // spec.block_size)
    return total


def check_budget(vllm_config, kv_cache_config, settings: VkvConnectorConfig) -> None:
    """The budget must back one request of max_model_len, the headroom and the null block:
    with less, such a request would wait for ever."""
    if not settings.memory_budget and not settings.shared_budget:
        return  # every block of vLLM's pool, which vLLM itself sized for max_model_len
    block = block_bytes(kv_cache_config)
    max_model_len = vllm_config.model_config.max_model_len
    request_blocks = _blocks_of_one_request(vllm_config, kv_cache_config)
    blocks = request_blocks + settings.headroom_blocks + 1
    need = backed_bytes(blocks, block, page_bytes(settings))
    groups = len(kv_cache_config.kv_cache_groups)
    where = f" over {groups} KV cache groups" if groups > 1 else ""
    what = (f"one request of max_model_len {max_model_len} tokens ({request_blocks} blocks{where}) + headroom_blocks "
            f"{settings.headroom_blocks} + vLLM's null block = {blocks} blocks of {block} bytes = {need} bytes of pages")
    if settings.memory_budget and settings.memory_budget < need:
        raise ValueError(
            f"VkvConnector: kv_connector_extra_config['memory_budget'] = {settings.memory_budget} bytes is less "
            f"than {what}; raise memory_budget to at least {need}, or lower --max-model-len")
    from .workers import engine_budget_names
    for name in engine_budget_names(vllm_config, settings):  # with TP/PP: every GPU's budget
        import vkv
        try:
            capacity = vkv.SharedBudget.open(name).stats()["capacity_bytes"]
        except ValueError as error:  # no such budget: name the setting and the command that makes it
            raise ValueError(
                f"VkvConnector: kv_connector_extra_config['shared_budget'] = {settings.shared_budget!r}: {error} "
                f"(python -m vkv.budget create {name} BYTES, e.g. 40GiB)") from None
        if capacity < need:
            raise ValueError(
                f"VkvConnector: the shared budget {name!r} (kv_connector_extra_config"
                f"['shared_budget']) holds {capacity} bytes, less than {what}; resize it (python -m vkv.budget "
                f"resize {name} {need}), or lower --max-model-len")


def check_view(name: str, view, num_blocks: int, block: int) -> None:
    """A layer's KV cache view as vLLM made it (register_kv_caches): its blocks must be
    ``block`` bytes apart (vkv backs block b as ``[b * block, (b + 1) * block)``), whatever
    the configs said."""
    if view.dim() == 0 or view.shape[0] != num_blocks:
        return  # not a [blocks, ...] view: nothing to compare
    stride = view.stride(0) * view.element_size()
    if stride != block:
        raise ValueError(
            f"VkvConnector: vLLM's KV cache view {name!r} puts its blocks {stride} bytes apart, but vkv backs "
            f"{block}-byte blocks, one run of all layers' bytes each (a layer-outermost layout); "
            f"{_WHAT_TO_DO_LAYOUT}")
