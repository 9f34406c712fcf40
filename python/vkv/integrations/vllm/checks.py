"""What VkvConnector refuses at startup: configurations it cannot serve, each one a one-line
ValueError naming the setting and what to change (docs/vllm.md, "Refused at startup").

Checked on vLLM's own config objects in the connector's ``__init__`` (scheduler and worker),
where vLLM 0.33 has resolved the KV cache layout (``KVCacheConfig.kv_cache_layout``,
``CacheConfig.kv_cache_layout``) and planned the KV buffer (``KVCacheTensor``). Imports
vllm (the connector's module does anyway).
"""

from typing import Optional

from .config import VkvConnectorConfig
from .block_geometry import BlockRanges, byte_runs

# vLLM's KVCacheLayout names whose outermost dimension is the block: block b of every layer
# is one run of bytes, which vkv backs (as one slot, or page by page). The others (LBNHC,
# LBHNC, LHBNC) give each layer a region of its own: block b is one range in each, backed
# page by page (block_ranges()).
BLOCK_OUTERMOST = ("BLNHC", "BLHNC", "BHLNC")
_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names (config/cache.py)
_WHAT_TO_DO_LAYOUT = ("set VLLM_KV_CACHE_LAYOUT=BLNHC (BLHNC for FlashInfer on Blackwell, SM100) with an attention "
                      "backend that accepts it (FLASH_ATTN, FLASHINFER; not FLEX_ATTENTION)")


def layer_outermost(kv_cache_config) -> bool:
    """vLLM's strides put each layer's blocks in a region of its own (LBNHC, LBHNC, LHBNC):
    a layer's stride spans all its blocks, as vLLM's own simple_kv_offload tells them apart."""
    num_blocks = kv_cache_config.num_blocks
    return num_blocks > 1 and any(tensor.layer_stride >= num_blocks * tensor.block_stride
                                  for tensor in kv_cache_config.kv_cache_tensors)


def block_bytes(kv_cache_config) -> int:
    """One vLLM block over every layer and KV cache group, padding included: what vkv backs
    for each block (the KVCacheTensors' ``block_stride`` in a block-outermost layout; the
    buffer's size over the blocks in a layer-outermost one, where block_stride is one layer's page)."""
    tensor = kv_cache_config.kv_cache_tensors[0]
    if layer_outermost(kv_cache_config):
        return tensor.size // kv_cache_config.num_blocks
    return tensor.block_stride


def _layer_spec(kv_cache_config, layer: str):
    """The KV cache spec of one layer (its group's, or its own in a UniformTypeKVCacheSpecs)."""
    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            return getattr(spec, "kv_cache_specs", {}).get(layer, spec)
    raise ValueError(f"VkvConnector: vLLM's KV cache tensor layer {layer!r} is in no KV cache group")


def block_ranges(vllm_config, kv_cache_config) -> BlockRanges:
    """Where block b's bytes lie in vLLM's buffer, from the KVCacheTensors' strides as vLLM's
    ``create_kv_cache_views()`` computes them (``compute_layout_strides``): one run of
    ``block_bytes`` in a block-outermost layout; in a layer-outermost one, the runs of each
    layer's page (one per layer in LBNHC and LBHNC, where K and V share the page; one per layer
    and head in LHBNC), every KV cache group's tensors together (groups overlay the same bytes)."""
    if not layer_outermost(kv_cache_config):
        return BlockRanges.one_run(block_bytes(kv_cache_config))
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes, compute_layout_strides
    from vllm.v1.kv_cache_layout import KVCacheLayout
    name, _ = _resolved_layout(vllm_config, kv_cache_config)
    layout = KVCacheLayout.__members__.get(_ALIASES.get(name, name)) if name else None
    num_blocks = kv_cache_config.num_blocks
    starts, lengths, strides = [], [], []
    for tensor in kv_cache_config.kv_cache_tensors:
        layers = len(tensor.layers)
        spec = _layer_spec(kv_cache_config, tensor.layers[0])
        if not getattr(spec, "has_layer_views", True):
            raise ValueError(
                f"VkvConnector: vLLM's KV cache layer {tensor.layers[0]!r} ({type(spec).__name__}) lays out its own "
                f"bytes in a layer-outermost buffer, so vkv cannot tell where a block of it lies; {_WHAT_TO_DO_LAYOUT}")
        if layout is not None and not layout.is_block_outermost:
            shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)  # (B, H, N, C in bytes)
            stride = compute_layout_strides(spec, num_blocks, layers, layout,
                                            fixed_strides=(tensor.layer_stride, tensor.block_stride, None, None, None))
            runs = byte_runs((layers, *shape[1:]), (stride[0], *stride[2:]))
        elif tensor.layer_stride == num_blocks * tensor.block_stride:  # no layout named: a layer's page is one run
            runs = [(layer * tensor.layer_stride, tensor.block_stride) for layer in range(layers)]
        else:
            raise ValueError(
                f"VkvConnector: vLLM's KV cache tensor is layer-outermost (layer_stride {tensor.layer_stride} bytes, "
                f"block_stride {tensor.block_stride}) but names no layout, so vkv cannot tell where a block's bytes "
                f"lie; {_WHAT_TO_DO_LAYOUT}")
        starts += [tensor.offset + start for start, _ in runs]
        lengths += [length for _, length in runs]
        strides += [tensor.block_stride] * len(runs)
    ranges = BlockRanges(starts, lengths, strides)
    size = kv_cache_config.kv_cache_tensors[0].size
    if ranges.end(num_blocks) > size:
        raise ValueError(f"VkvConnector: vLLM's KV cache tensors put {ranges.describe()}, past its {size}-byte buffer "
                         f"of {num_blocks} blocks; {_WHAT_TO_DO_LAYOUT}")
    return ranges


def page_bytes(settings: VkvConnectorConfig) -> int:
    """vkv's page for these settings: ``page_size``, else the device's (2 MiB GPU, 4 KiB host)."""
    from .block_geometry import default_page_bytes
    return settings.page_size or default_page_bytes(settings.device)


def backed_bytes(blocks: int, block: int, page: int, ranges: Optional[BlockRanges] = None) -> int:
    """Bytes of pages ``blocks`` adjacent blocks of ``block`` bytes need at most: the pages
    they touch (partial pages at both ends of each of their ``ranges``: one run unless given)."""
    ranges = ranges or BlockRanges.one_run(block)
    if ranges.is_one_run and block % page == 0:
        return blocks * block  # whole pages: a run of blocks shares none
    return ranges.pages_for(blocks, page) * page


def check_startup(vllm_config, kv_cache_config, settings: VkvConnectorConfig) -> None:
    """Every check below; raises the first failure's ValueError."""
    check_kv_cache_config(kv_cache_config)
    ranges = block_ranges(vllm_config, kv_cache_config)
    check_budget(vllm_config, kv_cache_config, settings, ranges)


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


def check_kv_cache_config(kv_cache_config) -> None:
    """Block b of every KV cache group and layer in the bytes ``[b * block_bytes, (b + 1) *
    block_bytes)`` of vLLM's one buffer where the strides are block-outermost (layer-outermost
    ones: block_ranges()). Any spec (full, sliding window, MLA, K and V of different sizes,
    Mamba state), any number of groups and padded pages qualify; host-resident groups
    (HiSparse) do not."""
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
    if layer_outermost(kv_cache_config):
        return  # each layer's region: block_ranges() checks where the blocks lie
    for tensor in tensors:
        layers = len(tensor.layers)
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


def check_budget(vllm_config, kv_cache_config, settings: VkvConnectorConfig,
                 ranges: Optional[BlockRanges] = None) -> None:
    """The budget (and this engine's cap in it) must back one request of max_model_len, the
    headroom and the null block: with less, such a request would wait for ever. A floor
    must fit the budget."""
    if not settings.memory_budget and not settings.shared_budget:
        return  # every block of vLLM's pool, which vLLM itself sized for max_model_len
    block = block_bytes(kv_cache_config)
    max_model_len = vllm_config.model_config.max_model_len
    request_blocks = _blocks_of_one_request(vllm_config, kv_cache_config)
    blocks = request_blocks + settings.headroom_blocks + 1
    need = backed_bytes(blocks, block, page_bytes(settings), ranges)
    groups = len(kv_cache_config.kv_cache_groups)
    where = f" over {groups} KV cache groups" if groups > 1 else ""
    what = (f"one request of max_model_len {max_model_len} tokens ({request_blocks} blocks{where}) + headroom_blocks "
            f"{settings.headroom_blocks} + vLLM's null block = {blocks} blocks of {block} bytes = {need} bytes of pages")
    if settings.memory_budget and settings.memory_budget < need:
        raise ValueError(
            f"VkvConnector: kv_connector_extra_config['memory_budget'] = {settings.memory_budget} bytes is less "
            f"than {what}; raise memory_budget to at least {need}, or lower --max-model-len")
    if settings.shared_budget_cap and settings.shared_budget_cap < need:
        raise ValueError(
            f"VkvConnector: kv_connector_extra_config['shared_budget_cap'] = {settings.shared_budget_cap} bytes is "
            f"less than {what}; raise shared_budget_cap to at least {need} (0: no cap), or lower --max-model-len")
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
        if settings.shared_budget_floor > capacity:
            raise ValueError(
                f"VkvConnector: kv_connector_extra_config['shared_budget_floor'] = {settings.shared_budget_floor} "
                f"bytes is more than the shared budget {name!r} holds, {capacity} bytes; lower the floor or resize "
                f"the budget (python -m vkv.budget resize {name} BYTES)")


def check_view(name: str, view, num_blocks: int, ranges: BlockRanges, offset: int) -> None:
    """A layer's KV cache view as vLLM made it (register_kv_caches), ``offset`` bytes into the
    buffer: every byte it gives block b must lie in the bytes vkv backs for block b
    (``ranges``), whatever the configs said. A view of kernel blocks (a manager block split
    into several, as vLLM does for some backends in layer-outermost layouts) counts the kernel
    blocks of a block together."""
    if view.dim() == 0 or view.shape[0] % num_blocks:
        return  # not a [blocks, ...] view: nothing to compare
    size = view.element_size()
    split = view.shape[0] // num_blocks
    stride = view.stride(0) * size * split
    sizes = (split, *view.shape[1:], size)
    strides = (view.stride(0) * size, *(s * size for s in view.stride()[1:]), 1)
    for start, length in byte_runs(sizes, strides):
        if not ranges.covers(offset + start, length, stride):
            raise ValueError(
                f"VkvConnector: vLLM's KV cache view {name!r} puts its blocks {stride} bytes apart, but vkv backs "
                f"{ranges.describe()} (the view's block 0 has the bytes {offset + start}..{offset + start + length}); "
                f"{_WHAT_TO_DO_LAYOUT}")
