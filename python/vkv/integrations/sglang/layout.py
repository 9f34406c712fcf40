"""Where an SGLang pool's per-layer buffers lie in one vkv reservation, and which bytes each
of the allocator's pages (vkv's blocks) owns there.

SGLang's MHA pool keeps, per layer, a K and a V tensor of ``[slots, heads, head_dim]`` (its
own pool cuts both from one allocation; vkv gives each its own pages). Its MLA pool keeps one ``[slots, 1, kv_cache_dim]`` tensor per
layer. vkv lays those tensors one after the other, each starting on a vkv page, with the
shapes and strides SGLang gives them, so every kernel sees ordinary tensors. Allocator page
``p`` holds token slots ``[p * page_size, (p + 1) * page_size)`` of every buffer: one byte
range per buffer, all of one geometry, ``start + p * stride`` for ``length`` bytes.
No torch, no SGLang: the GPU replay uses it where SGLang is not installed.
"""

import math
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np


@dataclass(frozen=True)
class Buffer:
    """One tensor of the pool: ``offset`` bytes into the reservation, ``shape`` of
    ``itemsize``-byte elements, contiguous; its rows of ``row_bytes`` are token slots."""

    offset: int
    shape: Tuple[int, ...]
    itemsize: int

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclass(frozen=True)
class PoolLayout:
    """``buffers``: every tensor the pool carves, in SGLang's order (per layer: the fused
    K/V tensor, or K then V, or the MLA tensor). ``regions``: (offset, row_bytes) of each
    token-slot array inside them (a fused tensor has two: K and V). ``reserved_bytes``: the
    reservation, whole pages."""

    buffers: Tuple[Buffer, ...]
    regions: Tuple[Tuple[int, int], ...]
    page_size: int  # tokens of one allocator page
    num_blocks: int  # allocator pages, the padded page 0 included
    reserved_bytes: int

    def ranges(self) -> List[Tuple[int, int, int]]:
        """vkv.BlockBacking's geometry: (start, length, stride) of block b in each region."""
        return [(offset, row * self.page_size, row * self.page_size) for offset, row in self.regions]

    def token_bytes(self) -> int:
        """Bytes one token slot occupies over every buffer."""
        return sum(row for _, row in self.regions)

    def held_floor(self, floor: int, vkv_page_bytes: int) -> int:
        """A floor as the engine can hold it: rounded up to whole steps of a vkv page in
        every region, the memory its pages come and go in (between two steps, the step
        above)."""
        step = vkv_page_bytes * len(self.regions)
        return -(-floor // step) * step


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _region_alignment(vkv_page_bytes: int, block_bytes: int) -> int:
    """Regions start on vkv pages and, where that costs at most 64 pages of padding, a whole
    number of blocks apart."""
    common = vkv_page_bytes * block_bytes // math.gcd(vkv_page_bytes, block_bytes)
    return common if common <= 64 * vkv_page_bytes else vkv_page_bytes


def mha_layout(*, size: int, page_size: int, layers: int, heads: int, head_dim: int, v_head_dim: int,
               itemsize: int, vkv_page_bytes: int) -> PoolLayout:
    """SGLang's MHATokenToKVPool in NHD layout (``size`` token slots + the padded page). K and
    V of a layer are two tensors, each on its own vkv pages (so that no page holds both K
    and V); V lies a whole number of K blocks after K, as in SGLang's fused halves, so
    kernels that reach V from K's base by block offsets still do."""
    rows = size + page_size
    k_row, v_row = heads * head_dim * itemsize, heads * v_head_dim * itemsize
    alignment = _region_alignment(vkv_page_bytes, k_row * page_size)
    buffers: List[Buffer] = []
    regions: List[Tuple[int, int]] = []
    offset = 0
    for _ in range(layers):
        for dim, row in ((head_dim, k_row), (v_head_dim, v_row)):
            buffers.append(Buffer(offset, (rows, heads, dim), itemsize))
            regions.append((offset, row))
            offset = _align(offset + _align(rows, page_size) * row, alignment)
    return PoolLayout(tuple(buffers), tuple(regions), page_size, _align(rows, page_size) // page_size,
                      _align(max(offset, 1), vkv_page_bytes))


def mla_layout(*, size: int, page_size: int, layers: int, kv_cache_dim: int, itemsize: int,
               vkv_page_bytes: int) -> PoolLayout:
    """SGLang's MLATokenToKVPool: one latent vector of ``kv_cache_dim`` per token and layer."""
    rows = size + page_size
    row = kv_cache_dim * itemsize
    buffers, regions, offset = [], [], 0
    for _ in range(layers):
        buffers.append(Buffer(offset, (rows, 1, kv_cache_dim), itemsize))
        regions.append((offset, row))
        offset = _align(offset + rows * row, vkv_page_bytes)
    return PoolLayout(tuple(buffers), tuple(regions), page_size, _align(rows, page_size) // page_size,
                      _align(max(offset, 1), vkv_page_bytes))


def views(flat, layout: PoolLayout, dtype) -> List:  # type: ignore[no-untyped-def]
    """The pool's tensors over ``flat`` (a uint8 torch tensor over the reservation)."""
    return [flat[b.offset:b.offset + b.nbytes].view(dtype).view(b.shape) for b in layout.buffers]
