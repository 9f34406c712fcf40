"""The tensors KVCache hands out: views over the whole reservation that a debugging print,
pickle, deepcopy or torch.save cannot turn into a read of unmapped memory.

Every ``key(l)``/``value(l)`` views one storage the size of the whole reservation, most
of it not backed by pages (``zero_page=False``): reading there is an illegal address that
ends the CUDA context on a GPU (the host backend reads zeros there; the checks below act
alike on both, so that what works on the CPU does not crash on a GPU). Torch's repr,
pickling, deepcopy and torch.save read, or copy the whole storage of, the tensor they are
given. So these tensors are a ``ReservationView`` subclass that does that only for the
bytes the view covers, and only when every one of them is backed by a page a request
claims (tokens below the slot's seq_len); otherwise it raises a RuntimeError saying so.
Views made by indexing and the usual view methods stay ReservationViews; arithmetic and
``clone()`` give plain tensors (their own storage, safe anyway). Views made by free
functions (``torch.narrow(k, ...)``) are plain tensors over the reservation: clone what
you need before printing those.

Torch functions on a ReservationView run as on a plain tensor (torch-function dispatch is
disabled for the class: no overhead on the engine's path).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch

# Views whose byte check would build more addresses than this are checked in pieces.
_CHECK_CHUNK = 1 << 22


class Backing:
    """What the views of one cache need to tell backed bytes from unbacked ones."""

    def __init__(self, cache: Any, zero_page: bool) -> None:
        core = cache._core
        # The core, not the KVCache: the views' storage keeps the core alive past close()
        # anyway (its pages stay mapped), and its seq_lens still tell what is backed.
        self._core = core
        self.zero_page = zero_page  # unbacked memory reads as zeros: every byte is readable
        self.base: int = core.base
        self.page_bytes: int = core.page_bytes
        self.token_bytes: int = core.token_bytes
        self.max_batch_size: int = cache.max_batch_size
        self.slot_bytes: int = -(-cache.max_context_len * self.token_bytes // self.page_bytes) * self.page_bytes
        self.region_bytes: int = self.slot_bytes * self.max_batch_size

    def backed_bytes_per_slot(self) -> np.ndarray:
        """Bytes at the start of each slot's run (in every region) that pages claimed by its
        tokens back."""
        tokens = np.asarray(self._core.seq_lens(), dtype=np.int64)
        return -(-tokens * self.token_bytes // self.page_bytes) * self.page_bytes

    def unbacked_elements(self, view: torch.Tensor) -> int:
        """How many of the view's elements lie outside backed memory; 0 for a tensor that
        is not over this reservation, and with zero_page=True."""
        if self.zero_page or view.untyped_storage().data_ptr() != self.base:
            return 0  # readable everywhere, or a copy with its own memory
        itemsize = view.element_size()
        start = view.data_ptr() - self.base
        backed = self.backed_bytes_per_slot()
        return _count_unbacked(start, list(view.shape), [s * itemsize for s in view.stride()], itemsize,
                               backed, self.slot_bytes, self.region_bytes)


def _count_unbacked(start: int, shape: list, strides: list, itemsize: int, backed: np.ndarray,
                    slot_bytes: int, region_bytes: int) -> int:
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel == 0:
        return 0
    if numel > _CHECK_CHUNK and shape:
        # Split the largest dimension until each piece's addresses fit in memory.
        dim = int(np.argmax(shape))
        half = shape[dim] // 2
        first = shape.copy()
        first[dim] = half
        second = shape.copy()
        second[dim] = shape[dim] - half
        return (_count_unbacked(start, first, strides, itemsize, backed, slot_bytes, region_bytes)
                + _count_unbacked(start + half * strides[dim], second, strides, itemsize, backed, slot_bytes,
                                  region_bytes))
    addresses = np.full((1,), start, dtype=np.int64)
    for size, stride in zip(shape, strides):
        addresses = (addresses[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    within_region = addresses % region_bytes
    slot = within_region // slot_bytes
    # An element is backed when its last byte is below the slot's backed prefix.
    return int(np.count_nonzero(within_region % slot_bytes + itemsize > backed[slot]))


class ReservationView(torch.Tensor):
    """A tensor over a KVCache's reservation (see the module's docstring).

    Thread-safety: as a torch.Tensor; the backed check reads the cache's seq_lens, so a
    step() racing with a print may see either state.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _vkv_backing: Optional[Backing] = None

    @staticmethod
    def wrap(tensor: torch.Tensor, backing: Optional[Backing]) -> "ReservationView":
        view = tensor.as_subclass(ReservationView)
        view._vkv_backing = backing
        return view

    def _plain(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def _backed_copy(self, what: str) -> torch.Tensor:
        """The view's elements in a tensor of their own; RuntimeError when some are unbacked."""
        backing = self._vkv_backing
        unbacked = 0 if backing is None else backing.unbacked_elements(self)
        if unbacked:
            raise RuntimeError(
                f"{what} of a vkv cache view of shape {list(self.shape)} would read {unbacked} of its "
                f"{self.numel()} elements from memory no page backs (zero_page=False): index the tokens "
                "step() backed first, e.g. cache.key(layer)[slot, :seq_len]")
        with torch.no_grad():
            return self._plain().clone()

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        try:
            copy = self._backed_copy("printing")
        except RuntimeError as error:
            return (f"<vkv cache view: shape={list(self.shape)}, dtype={self.dtype}, device={self.device}; "
                    f"not printed: {error}>")
        return repr(copy)

    def __str__(self) -> str:
        return self.__repr__()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self._backed_copy("formatting").__format__(spec)
        return self.__repr__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._backed_copy("pickling").__reduce_ex__(protocol)

    def __deepcopy__(self, memo: Dict[int, Any]) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        copy = self._backed_copy("copy.deepcopy")
        memo[id(self)] = copy
        return copy

    def tolist(self) -> Any:
        return self._backed_copy("tolist()").tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return self._backed_copy("numpy()").numpy(*args, **kwargs)

    def item(self) -> Any:
        return self._backed_copy("item()").item()


def _keeps_view(name: str) -> Any:
    method = getattr(torch.Tensor, name)

    def wrapper(self: ReservationView, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if isinstance(result, torch.Tensor):
            return ReservationView.wrap(result, self._vkv_backing)
        if isinstance(result, (tuple, list)):
            return type(result)(ReservationView.wrap(part, self._vkv_backing) for part in result)
        return result

    wrapper.__name__ = name
    wrapper.__doc__ = method.__doc__
    return wrapper


# The methods that return views of the same memory: their results stay ReservationViews.
for _name in ("__getitem__", "view", "view_as", "reshape", "reshape_as", "narrow", "select", "permute",
              "transpose", "swapaxes", "movedim", "t", "flatten", "unflatten", "squeeze", "unsqueeze", "expand",
              "expand_as", "as_strided", "detach", "unbind", "split", "chunk", "tensor_split", "unfold",
              "diagonal", "contiguous"):
    setattr(ReservationView, _name, _keeps_view(_name))
del _name
