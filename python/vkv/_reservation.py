"""The one tensor over a cache's (or a block backing's) whole reservation (uint8), that every key and value view is
cut from: torch.from_dlpack of vkv._C.reservation_dlpack (python/bindings/reservation.cpp),
on the cache's device. It keeps the cache's memory reserved and mapped while any view of it
lives, closed cache or not."""

from typing import Any

import torch

from . import _C


def reservation_tensor(core: Any) -> torch.Tensor:
    """``core``: a ``vkv._C.KvCache`` or a ``vkv._C.BlockBacking``."""
    return torch.from_dlpack(_C.reservation_dlpack(core))
