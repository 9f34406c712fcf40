"""step()'s seq_lens given as a tensor, for the bindings: vkv._C links no libtorch, so it reads
lists, tuples and buffers (numpy) itself and hands anything else here first, to be checked in
the caller's words and made a host int64 array (a CUDA tensor is copied, which synchronizes)."""

from typing import Any

import numpy as np
import torch


def host_seq_lens(seq_lens: Any) -> np.ndarray:
    tensor = seq_lens if isinstance(seq_lens, torch.Tensor) else torch.from_dlpack(seq_lens)
    if tensor.dim() != 1:
        raise ValueError(f"seq_lens must be one-dimensional, got {tensor.dim()} dimensions")
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"seq_lens must hold integers, got a tensor of {tensor.dtype}")
    return tensor.detach().to("cpu", torch.int64).numpy()
