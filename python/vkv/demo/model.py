"""A Llama-architecture decoder in plain PyTorch, random weights, any size.

The forward pass is the real computation of a serving engine (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU); the weights are random because the demo measures the
system, not the text. Attention reads and writes the KV cache through a ``KvStore``
(kv_stores.py), so the same model runs on vkv, on a paged cache and on a static one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize


SHAPES = {
    "llama3-8b": ModelShape("llama3-8b", num_layers=32, hidden=4096, intermediate=14336, num_heads=32,
                            num_kv_heads=8, vocab=128256),
    "tiny": ModelShape("tiny", num_layers=4, hidden=256, intermediate=688, num_heads=8, num_kv_heads=2,
                       vocab=1024),
}


class LlamaModel:
    """Weights and forward passes; ``prefill`` for one prompt, ``decode`` for a batch."""

    def __init__(self, shape: ModelShape, device: torch.device, dtype: torch.dtype, max_context: int,
                 seed: int = 0) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        self.heads, self.kv_heads = shape.num_heads, shape.num_kv_heads  # this rank's (all, unsharded)
        self.group = None  # the tensor-parallel process group once sharded
        generator = torch.Generator(device=device).manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:  # small enough that activations stay finite
            return (torch.randn(rows, cols, generator=generator, device=device) / math.sqrt(cols)).to(dtype)

        s = shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.embedding = weight(s.vocab, s.hidden)
        self.layers = [{
            "qkv": weight(q_size + 2 * kv_size, s.hidden),
            "out": weight(s.hidden, q_size),
            "gate_up": weight(2 * s.intermediate, s.hidden),
            "down": weight(s.hidden, s.intermediate),
            "norm1": torch.ones(s.hidden, device=device, dtype=dtype),
            "norm2": torch.ones(s.hidden, device=device, dtype=dtype),
        } for _ in range(s.num_layers)]
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm_head = weight(s.vocab, s.hidden)
        positions = torch.arange(max_context, dtype=torch.float32)
        inverse = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        angles = torch.outer(positions, inverse)
        self.cos = angles.cos().to(device, dtype)
        self.sin = angles.sin().to(device, dtype)

    def shard(self, rank: int, world_size: int, group=None) -> "LlamaModel":
        """Keeps this tensor-parallel rank's heads and MLP columns (Megatron-style): Q/K/V
        and gate/up by rows, the output and down projections by columns, their partial
        sums all-reduced. Built from the full seeded weights, so it computes what the
        unsharded model does."""
        s = self.shape
        if s.num_kv_heads % world_size or s.intermediate % world_size:
            raise ValueError(f"{s.name}: {s.num_kv_heads} KV heads / {s.intermediate} MLP columns do not split "
                             f"over {world_size} ranks")
        self.heads, self.kv_heads, self.group = s.num_heads // world_size, s.num_kv_heads // world_size, group
        d, mlp = s.head_dim, s.intermediate // world_size
        q, kv = s.num_heads * d, s.num_kv_heads * d

        def rows(weight, start, count):
            return weight[start:start + count]

        for layer in self.layers:
            qkv = layer["qkv"]
            layer["qkv"] = torch.cat([rows(qkv, rank * self.heads * d, self.heads * d),
                                      rows(qkv, q + rank * self.kv_heads * d, self.kv_heads * d),
                                      rows(qkv, q + kv + rank * self.kv_heads * d, self.kv_heads * d)]).contiguous()
            layer["out"] = layer["out"][:, rank * self.heads * d:(rank + 1) * self.heads * d].contiguous()
            gate_up = layer["gate_up"]
            layer["gate_up"] = torch.cat([rows(gate_up, rank * mlp, mlp),
                                          rows(gate_up, s.intermediate + rank * mlp, mlp)]).contiguous()
            layer["down"] = layer["down"][:, rank * mlp:(rank + 1) * mlp].contiguous()
        return self

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(partial, group=self.group)
        return partial

    # -- pieces ------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + 1e-5)).to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]; rotates pairs (first half, second half)."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def _qkv(self, layer: dict, x: torch.Tensor, positions: torch.Tensor):
        d = self.shape.head_dim
        q, k, v = (x @ layer["qkv"].T).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q = self._rope(q.view(-1, self.heads, d), positions)
        k = self._rope(k.view(-1, self.kv_heads, d), positions)
        return q, k, v.view(-1, self.kv_heads, d)

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
        return self._reduce((F.silu(gate) * up) @ layer["down"].T)

    def _next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self._rms_norm(hidden, self.final_norm) @ self.lm_head.T).argmax(-1)

    # -- forward passes ------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, store, slot: int, tokens: torch.Tensor, start: int = 0) -> int:
        """Run one prompt (token ids [T]) at positions [start, start + T), write its K/V
        into ``slot``; the next token id. With ``start`` > 0 the slot already holds the
        first ``start`` tokens' K/V (a shared prefix) and the prompt attends to them too."""
        count = tokens.numel()
        positions = torch.arange(start, start + count, device=self.device)
        # Token i sees keys [0, start + i]: causal, aligned to the last key.
        mask = (torch.arange(start + count, device=self.device)[None] <= positions[:, None]) if start else None
        x = self.embedding[tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), positions)
            store.write_prompt(index, slot, k, v, start)
            if start:
                k, v = store.cached_kv(index, slot, start + count)
            # A fresh prompt attends to its own K/V: the same kernel for every KV store.
            attention = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=mask, is_causal=not start, enable_gqa=True)[0].transpose(0, 1)
            x = x + self._reduce(attention.reshape(x.shape[0], -1) @ layer["out"].T)
            x = x + self._mlp(layer, self._rms_norm(x, layer["norm2"]))
        return int(self._next_tokens(x[-1:])[0])

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one whole sequence, no KV cache: a teacher-forced check."""
        positions = torch.arange(tokens.numel(), device=self.device)
        x = self.embedding[tokens]
        for layer in self.layers:
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), positions)
            attention = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            x = x + self._reduce(attention.reshape(x.shape[0], -1) @ layer["out"].T)
            x = x + self._mlp(layer, self._rms_norm(x, layer["norm2"]))
        return (self._rms_norm(x, self.final_norm) @ self.lm_head.T).float()

    @torch.inference_mode()
    def decode(self, store, batch) -> torch.Tensor:
        """One token for each running request; ``batch`` is the store's DecodeBatch."""
        x = self.embedding[batch.tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), batch.positions)
            store.write_tokens(index, batch, k, v)
            attention = store.decode_attention(index, batch, q)
            x = x + self._reduce(attention.reshape(x.shape[0], -1) @ layer["out"].T)
            x = x + self._mlp(layer, self._rms_norm(x, layer["norm2"]))
        return self._next_tokens(x)
