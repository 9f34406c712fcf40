"""Where vLLM's blocks lie in its KV buffer: the ranges vkv.BlockBacking backs for each
block (one run in a block-outermost layout, one range per layer region in a
layer-outermost one), and the page each device's backend maps."""

from typing import List, Tuple

from vkv._parameters import resolve_device

_HOST_PAGE = 4096
_CUDA_PAGE = 2 << 20


def default_page_bytes(device: str) -> int:
    """vkv's page on ``device``: 2 MiB on a GPU, 4 KiB on the host backend."""
    return _HOST_PAGE if str(resolve_device(device)) == "cpu" else _CUDA_PAGE


def byte_runs(sizes, strides) -> "list[tuple[int, int]]":
    """The contiguous byte runs ``(start, length)`` of a strided view whose innermost axis is
    bytes (stride 1), in address order: the axes whose strides chain from it (each the run
    so far) join the run; every index of the other axes starts one."""
    axes = sorted((stride, size) for size, stride in zip(sizes, strides) if size > 1)
    run, inner = 1, 0
    while inner < len(axes) and axes[inner][0] == run:
        run *= axes[inner][1]
        inner += 1
    starts = [0]
    for stride, size in axes[inner:]:
        starts = [start + i * stride for start in starts for i in range(size)]
    return sorted((start, run) for start in starts)


class BlockRanges:
    """Where vLLM block b's bytes lie in its buffer: range r is the ``lengths[r]`` bytes at
    ``starts[r] + b * strides[r]``. A block-outermost layout is one range (all layers' bytes of
    a block in one run); a layer-outermost one (LBNHC, LBHNC) one range per layer, as each
    layer has a region of its own (LHBNC: per layer and head). Ranges of several KV cache groups
    that overlay the same bytes appear once."""

    def __init__(self, starts, lengths, strides) -> None:
        import numpy as np
        unique = sorted(set(zip(map(int, starts), map(int, lengths), map(int, strides))))
        if not unique or any(length <= 0 or stride <= 0 for _, length, stride in unique):
            raise ValueError(f"vkv.integrations.vllm: block ranges need a positive length and stride: {unique}")
        self.starts, self.lengths, self.strides = (np.array(column, dtype=np.int64) for column in zip(*unique))

    @classmethod
    def one_run(cls, block_bytes: int) -> "BlockRanges":
        """Block b = ``[b * block_bytes, (b + 1) * block_bytes)`` (block-outermost layouts)."""
        return cls([0], [block_bytes], [block_bytes])

    @classmethod
    def per_layer(cls, layers: int, layer_block_bytes: int, num_blocks: int) -> "BlockRanges":
        """Layer-outermost (LBNHC, LBHNC) with one tensor: layer l's region is ``num_blocks``
        pages of ``layer_block_bytes``, block b the page at ``b * layer_block_bytes`` in each."""
        region = num_blocks * layer_block_bytes
        return cls([layer * region for layer in range(layers)], [layer_block_bytes] * layers,
                   [layer_block_bytes] * layers)

    def as_tuples(self) -> List[Tuple[int, int, int]]:
        """``[(start, length, stride), ...]``: vkv.BlockBacking's ``ranges``."""
        return [(int(s), int(n), int(t)) for s, n, t in zip(self.starts, self.lengths, self.strides)]

    @property
    def is_one_run(self) -> bool:
        """Block b is the one run ``[b * B, (b + 1) * B)``: blocks tile the buffer."""
        return len(self.starts) == 1 and self.starts[0] == 0 and self.lengths[0] == self.strides[0]

    def __len__(self) -> int:
        return len(self.starts)

    def end(self, num_blocks: int) -> int:
        """One past the last byte any of ``num_blocks`` blocks uses."""
        return int((self.starts + (num_blocks - 1) * self.strides + self.lengths).max())

    def covers(self, start: int, length: int, stride: int) -> bool:
        """Whether the run ``[start, start + length)`` of block 0, repeated ``stride`` bytes apart
        for each block, lies inside one range of every block."""
        inside = (self.strides == stride) & (self.starts <= start) & (start + length <= self.starts + self.lengths)
        return bool(inside.any())

    def pages_for(self, blocks: int, page_bytes: int) -> int:
        """The most pages ``blocks`` adjacent blocks touch (partial pages at both ends of each range)."""
        spans = (blocks - 1) * self.strides + self.lengths
        return int((-(-spans // page_bytes) + 1).sum())

    def describe(self) -> str:
        if self.is_one_run:
            return f"{int(self.strides[0])}-byte blocks, one run of all layers' bytes each"
        return (f"block b as {len(self)} ranges of {sorted(set(self.lengths.tolist()))} bytes at "
                f"{self.starts[:3].tolist()}{'...' if len(self) > 3 else ''} + b * {sorted(set(self.strides.tolist()))}")
