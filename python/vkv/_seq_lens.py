"""Integers given as a tensor (step()'s seq_lens, a block backing's release lists), for the bindings: vkv._C links no libtorch, so it reads
lists, tuples and buffers (numpy) itself and hands anything else here, to be made a host
array it reads as a buffer (its shape checked there). A CUDA tensor is copied, which
synchronizes; a CPU one is viewed, not copied."""

from typing import Any

import numpy as np
import torch

_INTEGERS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                       torch.uint64})


def host_integers(values: Any, name: str = "seq_lens") -> np.ndarray:
    """``values`` (a tensor, or anything with ``__dlpack__``) as a host numpy array; ``name``:
    what the caller calls it (seq_lens, release, blocks)."""
    tensor = values if isinstance(values, torch.Tensor) else torch.from_dlpack(values)
    if tensor.dtype not in _INTEGERS:
        raise ValueError(f"{name} must hold integers, got a tensor of {tensor.dtype}")
    return (tensor if tensor.is_cpu else tensor.cpu()).numpy()
