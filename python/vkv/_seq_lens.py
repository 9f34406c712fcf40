"""step()'s seq_lens given as a tensor, for the bindings: vkv._C links no libtorch, so it reads
lists, tuples and buffers (numpy) itself and hands anything else here, to be made a host
array it reads as a buffer (its shape checked there). A CUDA tensor is copied, which
synchronizes; a CPU one is viewed, not copied."""

from typing import Any

import numpy as np
import torch

_INTEGERS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                       torch.uint64})


def host_seq_lens(seq_lens: Any) -> np.ndarray:
    tensor = seq_lens if isinstance(seq_lens, torch.Tensor) else torch.from_dlpack(seq_lens)
    if tensor.dtype not in _INTEGERS:
        raise ValueError(f"seq_lens must hold integers, got a tensor of {tensor.dtype}")
    return (tensor if tensor.is_cpu else tensor.cpu()).numpy()
