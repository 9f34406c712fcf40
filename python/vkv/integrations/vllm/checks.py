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
# is one run of bytes, which vkv backs as one slot.
BLOCK_OUTERMOST = ("BLNHC", "BLHNC", "BHLNC")
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names (config/cache.py)
_WHAT_TO_DO_LAYOUT = ("set VLLM_KV_CACHE_LAYOUT=BLNHC (BLHNC for FlashInfer on Blackwell, SM100) with an attention "
                      "backend that accepts it (FLASH_ATTN, FLASHINFER; not FLEX_ATTENTION)")


def block_bytes(spec, num_layers: int) -> int:
    """One vLLM block over all layers, unpadded: what vkv backs as one slot."""
    return spec.block_size * num_layers * 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize


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
    """One full-attention group in one backing tensor whose block b is exactly the bytes
    ``[b * block_bytes, (b + 1) * block_bytes)``: block-outermost strides, no padding."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"VkvConnector: {len(groups)} KV cache groups (a hybrid model); this version "
                         "backs models with one full-attention group only")
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or spec.head_size_v != spec.head_size:
        raise ValueError(f"VkvConnector: KV cache spec {type(spec).__name__} is not supported; this "
                         "version backs full attention with equal K and V head sizes only")
    if len(kv_cache_config.kv_cache_tensors) != 1:
        raise ValueError("VkvConnector: expected one backing KV cache tensor (vLLM's standardised layout), got "
                         f"{len(kv_cache_config.kv_cache_tensors)}")
    tensor = kv_cache_config.kv_cache_tensors[0]
    layers = len(groups[0].layer_names)
    block = block_bytes(spec, layers)
    num_blocks = kv_cache_config.num_blocks
    if layers > 1 and tensor.block_stride < tensor.layer_stride:
        raise ValueError(
            f"VkvConnector: vLLM's KV cache tensor is layer-outermost (layer_stride {tensor.layer_stride} bytes, "
            f"block_stride {tensor.block_stride}), but vkv backs each block as one run of all its layers' bytes; "
            f"{_WHAT_TO_DO_LAYOUT}")
    if tensor.offset != 0 or tensor.block_stride != block or tensor.size != num_blocks * block:
        raise ValueError(
            f"VkvConnector: vLLM's KV buffer is {tensor.size} bytes, {tensor.block_stride} a block (pages of "
            f"{spec.page_size_bytes} bytes a layer), but vkv backs {num_blocks * block}, {block} a block ({layers} "
            f"layers x {block // layers} bytes): padded pages are not supported yet; pick a --block-size, "
            "--kv-cache-dtype and attention backend whose pages vLLM does not pad (page_size_padded, "
            "block_stride_alignment)")


def check_budget(vllm_config, kv_cache_config, settings: VkvConnectorConfig) -> None:
    """The budget must back one request of max_model_len, the headroom and the null block:
    with less, such a request would wait for ever."""
    if not settings.memory_budget and not settings.shared_budget:
        return  # every block of vLLM's pool, which vLLM itself sized for max_model_len
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    block = block_bytes(spec, len(kv_cache_config.kv_cache_groups[0].layer_names))
    max_model_len = vllm_config.model_config.max_model_len
    request_blocks = -(-max_model_len // spec.block_size)
    blocks = request_blocks + settings.headroom_blocks + 1
    need = blocks * block
    what = (f"one request of max_model_len {max_model_len} tokens ({request_blocks} blocks of {spec.block_size} "
            f"tokens) + headroom_blocks {settings.headroom_blocks} + vLLM's null block = {blocks} blocks of {block} "
            f"bytes = {need} bytes")
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
    ``block`` bytes apart, one vkv slot each, whatever the configs said."""
    if view.dim() == 0 or view.shape[0] != num_blocks:
        return  # not a [blocks, ...] view: nothing to compare
    stride = view.stride(0) * view.element_size()
    if stride != block:
        raise ValueError(
            f"VkvConnector: vLLM's KV cache view {name!r} puts its blocks {stride} bytes apart, but vkv backs "
            f"{block}-byte blocks, one run of all layers' bytes each (a layer-outermost or padded layout); "
            f"{_WHAT_TO_DO_LAYOUT}")
