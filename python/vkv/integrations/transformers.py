"""VkvCache: a transformers ``Cache`` whose keys and values live in a ``vkv.KVCache``.

    from vkv.integrations.transformers import VkvCache

    cache = VkvCache.from_model(model, max_batch_size=8, max_context_len=4096)
    out = model.generate(**inputs, **cache.as_kwargs(), max_new_tokens=64)
    cache.reset()                      # its slots go back to the KVCache for the next generation

Each batch row of a generation owns one vkv slot. transformers sees, per layer, K and V
tensors ``[batch, kv_heads, tokens, head_dim]`` that are views (``transpose``) of the vkv
slots: the rows of a left-padded batch hold their padding in the same positions as
``DynamicCache``'s, so masks, positions and tokens agree with it exactly. When a batch's
slots are adjacent (``alloc_reqids(..., contiguous=True)`` finds a run, the usual case),
no step copies the history: ``update`` writes the new tokens into the slots and returns
views. Otherwise (no adjacent run was free) the history is gathered into new tensors each
step, as the docstrings of ``update`` say.

Several generations may share one KVCache (``VkvCache(kv_cache)`` each): each owns its
slots and steps only those (``KVCache.step({slot: tokens})``).

Passing it: ``**cache.as_kwargs()`` is ``cache=cache`` on transformers that take a Cache
under that name (5.24 on: ``past_key_values`` is deprecated there, and ``forward()`` stops
taking it in 5.40) and ``past_key_values=cache`` on older ones (5.13 to 5.23).

Supported: transformers 5.13 (the first whose cache layers declare ``get_max_length``) up
to the newest 5.x; ``scripts/test_transformers_versions.sh`` tests the oldest and the newest.

Thread-safety: one VkvCache belongs to one generation and is not thread-safe (as
transformers' caches); VkvCaches sharing a KVCache may run in different threads.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

try:
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("vkv.integrations.transformers needs transformers >= 5.13: "
                      "pip install 'transformers>=5.13,<6'") from error

from .._cache import KVCache
from .._errors import OutOfMemory

_OLDEST = (5, 13)  # pyproject.toml's transformers extra says the same
if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < _OLDEST:  # pragma: no cover
    raise ImportError(f"vkv.integrations.transformers needs transformers >= 5.13, found {transformers.__version__}: "
                      "pip install 'transformers>=5.13,<6'")

__all__ = ["VkvCache", "cache_kwarg"]


def cache_kwarg(model: Any = None) -> str:
    """The keyword under which ``model.forward`` (and ``generate``) takes a ``Cache``:
    ``"cache"`` where transformers names it so (5.24 on), else ``"past_key_values"``.

    Without ``model``, what this transformers' generation code takes.
    """
    if model is not None:
        parameters = inspect.signature(model.forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
    from transformers.generation.utils import GenerationMixin

    generation = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in generation else "past_key_values"

_SUPPORTED_LAYER_TYPES = ("full_attention",)


class VkvCache(Cache):
    """A transformers ``Cache`` backed by a ``vkv.KVCache``: one vkv slot per batch row.

    Build it with ``VkvCache.from_model(model, max_batch_size=..., max_context_len=...)``
    (a KVCache of its own, closed by ``close()``), ``VkvCache.from_config(config, ...)``,
    or ``VkvCache(kv_cache)`` over a KVCache you share between generations.

    Slots are taken at the first ``update`` (prefill), as many as the batch has rows,
    adjacent when possible, and given back by ``reset()``/``close()``. Tokens are backed
    by ``step`` on the slots before they are written. ``crop`` steps the slots back;
    ``reorder_cache`` (beam search), ``batch_select_indices`` and
    ``batch_repeat_interleave`` give the new rows vkv slots that share the source rows'
    full pages (``KVCache.share_prefix``; only a partly filled last page is copied) and
    free the old ones; that waits on the host for the current stream once per call.
    """

    is_compileable = False

    def __init__(self, kv_cache: KVCache, *, owns_kv_cache: bool = False) -> None:
        """Use ``kv_cache`` (its layers, heads, head_dim, dtype and device are the model's).

        Args:
            kv_cache: the vkv cache this generation takes its slots from; others may share it.
            owns_kv_cache: ``close()`` closes ``kv_cache`` too (``from_model`` sets it).
        """
        if not isinstance(kv_cache, KVCache):
            raise ValueError(f"kv_cache = {kv_cache!r} must be a vkv.KVCache")
        self.kv_cache = kv_cache
        self._owns_kv_cache = bool(owns_kv_cache)
        self._slots: List[int] = []     # batch row -> vkv slot
        self._first: Optional[int] = None  # the first slot when they are adjacent and ascending
        self._rows: Optional[torch.Tensor] = None  # slot ids on the device, when they are not
        self._stepped = 0                  # tokens every slot of this generation has backed
        super().__init__(layers=[VkvLayer(self, layer) for layer in range(kv_cache.num_layers)])

    # -- construction from a model ------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: Any,
        max_batch_size: int,
        max_context_len: int,
        device: Union[str, torch.device, None] = None,
        dtype: Optional[torch.dtype] = None,
        **kv_cache_options: Any,
    ) -> "VkvCache":
        """A VkvCache over a new KVCache shaped for ``model`` (a transformers ``PreTrainedModel``).

        Args:
            max_batch_size: vkv slots: rows of all generations this cache serves at once
                (beam search needs ``2 * batch * num_beams`` while it reorders).
            max_context_len: most tokens per row, prompt (with padding) and generated.
            device: default: the model's device.
            dtype: default: the model's dtype.
            kv_cache_options: further ``vkv.KVCache`` keywords (``layout``, ``memory_budget``...).

        Raises:
            ValueError: the model has layers other than full attention (sliding-window,
                linear attention...), or a bad argument.
        """
        return cls.from_config(model.config, max_batch_size, max_context_len,
                               device=model.device if device is None else device,
                               dtype=model.dtype if dtype is None else dtype, **kv_cache_options)

    @classmethod
    def from_config(
        cls,
        config: Any,
        max_batch_size: int,
        max_context_len: int,
        device: Union[str, torch.device, None] = "auto",
        dtype: Optional[torch.dtype] = None,
        **kv_cache_options: Any,
    ) -> "VkvCache":
        """As ``from_model``, from a transformers ``PretrainedConfig`` (dtype: the config's, else float32)."""
        text = config.get_text_config(decoder=True)
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        if getattr(text, "sliding_window", None) is not None and getattr(text, "layer_types", None) is None:
            layer_types = ["sliding_attention"] * text.num_hidden_layers
        unsupported = sorted(set(layer_types) - set(_SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise ValueError(f"config.layer_types has {unsupported}: VkvCache supports {list(_SUPPORTED_LAYER_TYPES)} layers only")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        if dtype is None:
            dtype = getattr(text, "dtype", None)
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        kv_cache = KVCache(
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            dtype=dtype,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            device=device,
            **kv_cache_options,
        )
        return cls(kv_cache, owns_kv_cache=True)

    def as_kwargs(self, model: Any = None) -> Dict[str, "VkvCache"]:
        """``{"cache": self}`` or ``{"past_key_values": self}``, whichever ``model`` (default:
        this transformers' generation code) takes: ``model.generate(ids, **cache.as_kwargs())``,
        ``model(input_ids=ids, use_cache=True, **cache.as_kwargs())``."""
        return {cache_kwarg(model): self}

    # -- what transformers calls --------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` (``[batch, kv_heads, new_tokens, head_dim]``)
        to layer ``layer_idx``; returns its whole K and V, ``[batch, kv_heads, tokens, head_dim]``.

        With adjacent slots, the returned tensors are views of the vkv slots (no copy);
        otherwise they are gathered copies of every row's history.

        Raises:
            ValueError: the states do not match the KVCache (heads, head_dim, dtype, device),
                the batch size changed without ``reset()``, or the rows would exceed
                ``max_context_len``.
            vkv.OutOfMemory: the KVCache's memory budget cannot back the new tokens; nothing changed.
        """
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached in layer ``layer_idx`` (every row holds as many, padding included)."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    @property
    def batch_size(self) -> int:
        """Rows of the current generation, or -1 before its first update."""
        return len(self._slots) if self._slots else -1

    @property
    def slots(self) -> List[int]:
        """The vkv slot of each batch row (empty before the first update)."""
        return list(self._slots)

    @property
    def copies_history(self) -> bool:
        """True when this generation's slots are not adjacent, so each update gathers the history."""
        return bool(self._slots) and self._first is None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative count, as transformers passes);
        a positive value is the length to keep (transformers' older meaning). Steps the slots
        back: their pages stay, and a later step grows them again."""
        length = self.get_seq_length()
        keep = length + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, length)
        if keep < 0:
            raise ValueError(f"tokens_to_remove = {tokens_to_remove} removes more than the {length} cached tokens")
        if keep == length:
            return
        for layer in self.layers:
            layer.length = min(layer.length, keep)
        self._step(keep)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search); shares pages, copies only partial ones."""
        self._remap_rows([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices``, in that order."""
        self._remap_rows([int(i) for i in torch.as_tensor(indices).tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times in a row (``[a, a, b, b]`` for ``[a, b]`` and 2)."""
        self._remap_rows([row for row in range(len(self._slots)) for _ in range(repeats)])

    def reset(self) -> None:
        """Forget every token and give this generation's slots back to the KVCache (their
        pages are zero-filled and kept there for the next owner). The cache can serve a new
        generation, of any batch size."""
        self._release_slots()

    def close(self) -> None:
        """``reset()``, and close the KVCache if this cache built it. Idempotent."""
        if not self.kv_cache.closed:
            self._release_slots()
            if self._owns_kv_cache:
                self.kv_cache.close()

    def __enter__(self) -> "VkvCache":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"VkvCache(rows={len(self._slots)}, tokens={self.get_seq_length()}, slots={self._slots}, "
                f"copies_history={self.copies_history}, kv_cache={self.kv_cache!r})")

    # -- slots ---------------------------------------------------------------------------

    def _allocate(self, rows: int) -> None:
        try:
            slots = self.kv_cache.alloc_reqids(rows, contiguous=True)
        except ValueError:  # no run of adjacent slots is free: rows gather their history each step
            slots = self._alloc_any(rows)
        self._set_slots(slots)

    def _alloc_any(self, rows: int) -> List[int]:
        free = self.kv_cache.num_free_slots
        if rows > free:
            raise ValueError(f"the batch has {rows} rows but the vkv.KVCache has {free} free slots "
                             f"(max_batch_size = {self.kv_cache.max_batch_size}); reset() finished generations")
        return self.kv_cache.alloc_reqids(rows, contiguous=False)

    def _set_slots(self, slots: List[int]) -> None:
        self._slots = list(slots)
        adjacent = all(b == a + 1 for a, b in zip(slots, slots[1:]))
        self._first = slots[0] if adjacent else None
        self._rows = None if adjacent else torch.tensor(slots, device=self.kv_cache.device)

    def _step(self, tokens: int) -> None:
        if tokens > self.kv_cache.max_context_len:
            raise ValueError(f"the rows would hold {tokens} tokens but the vkv.KVCache has "
                             f"max_context_len = {self.kv_cache.max_context_len}")
        try:
            self.kv_cache.step({slot: tokens for slot in self._slots})
        except OutOfMemory as shortage:
            raise OutOfMemory(
                f"the vkv.KVCache's memory_budget cannot back {len(self._slots)} rows of {tokens} tokens: "
                f"{shortage.missing_pages} more pages are needed (nothing changed); reset() finished generations "
                f"or raise memory_budget. ({shortage})", shortage.missing_pages, shortage.missing_bytes) from shortage
        self._stepped = tokens

    def _release_slots(self) -> None:
        slots, self._slots, self._first, self._rows, self._stepped = self._slots, [], None, None, 0
        for layer in self.layers:
            layer.length = 0
        for slot in slots:
            self.kv_cache.free_reqid(slot)

    def _remap_rows(self, sources: Sequence[int]) -> None:
        """New row i holds old row sources[i]'s tokens."""
        if not self._slots or list(sources) == list(range(len(self._slots))):
            return
        rows = len(self._slots)
        bad = [s for s in sources if not 0 <= s < rows]
        if bad:
            raise ValueError(f"row indices {bad[:4]} are out of range: the cache holds {rows} rows")
        tokens = self._stepped
        if any(layer.length != tokens for layer in self.layers):
            raise ValueError("the layers hold different token counts: reorder between forward passes, not inside one")
        cache = self.kv_cache
        try:
            try:
                new = cache.alloc_reqids(len(sources), contiguous=True)
            except ValueError:
                new = cache.alloc_reqids(len(sources), contiguous=False)
        except ValueError:  # not enough free slots: move the rows in place instead (a copy of the history)
            self._remap_in_place(sources, tokens)
            return
        try:
            for dst, source in zip(new, sources):
                cache.share_prefix(self._slots[source], dst, tokens)
        except BaseException:
            for dst in new:
                cache.free_reqid(dst)
            raise
        old = self._slots
        self._set_slots(new)
        for slot in old:
            cache.free_reqid(slot)

    def _remap_in_place(self, sources: Sequence[int], tokens: int) -> None:
        if len(sources) != len(self._slots):
            raise ValueError(f"{len(sources)} rows need {len(sources) - len(self._slots)} more vkv slots, "
                             f"and the vkv.KVCache has {self.kv_cache.num_free_slots} free")
        index = torch.tensor([self._slots[s] for s in sources], device=self.kv_cache.device)
        target = torch.tensor(self._slots, device=self.kv_cache.device)
        for layer in range(self.kv_cache.num_layers):
            for tensor in (self.kv_cache.key(layer), self.kv_cache.value(layer)):
                tensor[target, :tokens] = tensor[index, :tokens]  # gathered first, then written


class VkvLayer(CacheLayerMixin):
    """One layer of a VkvCache: writes into and views the vkv slots of its cache's rows."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, cache: VkvCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.length = 0  # tokens of every row in this layer

    # transformers reads these; here they follow the cache's slots.
    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return bool(self.cache._slots)

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        pass  # derived from the slots

    @property
    def keys(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        return self._history(self.cache.kv_cache.key(self.layer_idx), self.length) if self.cache._slots else None

    @keys.setter
    def keys(self, value: Any) -> None:
        pass

    @property
    def values(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        return self._history(self.cache.kv_cache.value(self.layer_idx), self.length) if self.cache._slots else None

    @values.setter
    def values(self, value: Any) -> None:
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache._allocate(key_states.shape[0])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        self._expect_matching(key_states, value_states)
        if not cache._slots:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != len(cache._slots):
            raise ValueError(f"key_states has batch size {key_states.shape[0]} but this VkvCache holds "
                             f"{len(cache._slots)} rows: reset() it before a new generation")
        start, end = self.length, self.length + key_states.shape[2]
        if end > cache._stepped:
            cache._step(end)
        keys = cache.kv_cache.key(self.layer_idx)
        values = cache.kv_cache.value(self.layer_idx)
        self._write(keys, start, end, key_states)
        self._write(values, start, end, value_states)
        self.length = end
        return self._history(keys, end), self._history(values, end)

    def _write(self, tensor: torch.Tensor, start: int, end: int, states: torch.Tensor) -> None:
        new = states.transpose(1, 2)  # [batch, tokens, heads, dim], as vkv stores them
        first = self.cache._first
        if first is not None:
            tensor[first:first + len(self.cache._slots), start:end].copy_(new)
        else:
            tensor[self.cache._rows, start:end] = new

    def _history(self, tensor: torch.Tensor, end: int) -> torch.Tensor:
        first = self.cache._first
        if first is not None:
            return tensor[first:first + len(self.cache._slots), :end].transpose(1, 2)  # a view
        return tensor[self.cache._rows, :end].transpose(1, 2)  # gathered: a copy

    def _expect_matching(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        kv = self.cache.kv_cache
        expected = (kv.num_kv_heads, kv.head_dim)
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if states.dim() != 4 or tuple(states.shape[1:2]) + tuple(states.shape[3:]) != expected:
                raise ValueError(f"{name} has shape {tuple(states.shape)}: the vkv.KVCache expects "
                                 f"[batch, num_key_value_heads={expected[0]}, tokens, head_dim={expected[1]}]")
            if states.dtype != kv.dtype:
                raise ValueError(f"{name} has dtype {states.dtype} but the vkv.KVCache holds {kv.dtype}: "
                                 "build it with the model's dtype")
            if states.device != kv.device:
                raise ValueError(f"{name} is on {states.device} but the vkv.KVCache is on {kv.device}")

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand, like DynamicCache (up to the KVCache's max_context_len)

    # The rows' slots are shared by every layer: these act on the whole VkvCache, once.
    def reset(self) -> None:
        self.cache.reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a VkvCache crops all its layers together: call crop() on the VkvCache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a VkvCache reorders all its layers together: call reorder_cache() on the VkvCache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("call batch_repeat_interleave() on the VkvCache: its layers share their rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("call batch_select_indices() on the VkvCache: its layers share their rows")
