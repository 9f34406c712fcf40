"""A Llama-architecture decoder in plain PyTorch, random weights, any size.

The forward pass is the real computation of a serving engine (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU); the weights are random because the demo measures the
system, not the text. Attention reads and writes the KV cache through a ``KvStore``
(kv_stores.py), so the same model runs on vkv, on a paged cache and on a static one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
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
    "llama3.2-1b": ModelShape("llama3.2-1b", num_layers=16, hidden=2048, intermediate=8192, num_heads=32,
                              num_kv_heads=8, vocab=128256),
    "llama3.2-3b": ModelShape("llama3.2-3b", num_layers=28, hidden=3072, intermediate=8192, num_heads=24,
                              num_kv_heads=8, vocab=128256),
    "tiny": ModelShape("tiny", num_layers=4, hidden=256, intermediate=688, num_heads=8, num_kv_heads=2,
                       vocab=1024),
    "tiny-b": ModelShape("tiny-b", num_layers=2, hidden=128, intermediate=344, num_heads=4, num_kv_heads=2,
                         vocab=1024),  # a second small shape (the multi-engine demo's other engine)
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
        if self.device.type == "cuda":
            self._compact_layers()
        return self

    def _compact_layers(self) -> None:
        """Moves the layers' weights out to host memory and back: a shard cut while the full
        weights existed may sit in a segment of PyTorch's cache that their freed memory
        shares, which empty_cache() cannot give back to the driver (where a KV cache needs it)."""
        staged = [{name: weight.cpu() for name, weight in layer.items()} for layer in self.layers]
        self.layers = []
        torch.cuda.empty_cache()
        self.layers = [{name: weight.to(self.device) for name, weight in layer.items()} for layer in staged]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            torch.distributed.all_reduce(partial, group=self.group)
        return partial

    # -- pieces ------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-5)

    def _rotary(self, positions: torch.Tensor):
        """cos and sin [tokens, 1, head_dim / 2] of the positions: looked up once per forward."""
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def _qkv(self, layer: dict, x: torch.Tensor, rotary, write_rows=None):
        """q [T, heads, d], k and v [T, kv_heads, d]; q and k rotated together (pairs: first
        half, second half), written straight into one output (4 kernels, no concatenation).
        ``write_rows``: take each row's projection from that row (the padding rows of a
        CUDA-graph bucket copy row 0, so they write row 0's bytes)."""
        d, heads, kv_heads = self.shape.head_dim, self.heads, self.kv_heads
        qkv = x @ layer["qkv"].T
        if write_rows is not None:
            qkv = qkv.index_select(0, write_rows)
        qk = qkv[:, :(heads + kv_heads) * d].view(-1, heads + kv_heads, d)
        cos, sin = rotary
        first, second = qk.chunk(2, dim=-1)
        rotated = torch.empty_like(qk)
        rotated_first, rotated_second = rotated.chunk(2, dim=-1)
        torch.mul(first, cos, out=rotated_first).addcmul_(second, sin, value=-1)
        torch.mul(second, cos, out=rotated_second).addcmul_(first, sin)
        return rotated[:, :heads], rotated[:, heads:], qkv[:, (heads + kv_heads) * d:].view(-1, kv_heads, d)

    def _add_projection(self, x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x + inputs @ weight.T: one GEMM accumulating into x where nothing is reduced
        across ranks; tensor parallel, the partial product is all-reduced first."""
        if self.group is None:
            return x.addmm_(inputs, weight.T)
        return x + self._reduce(inputs @ weight.T)

    def _mlp_input(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
        return F.silu(gate) * up

    def _block_end(self, layer: dict, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The rest of a layer after attention: output projection, residual, MLP, residual."""
        x = self._add_projection(x, attention.reshape(x.shape[0], -1), layer["out"])
        return self._add_projection(x, self._mlp_input(layer, self._rms_norm(x, layer["norm2"])), layer["down"])

    def _next_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self._rms_norm(hidden, self.final_norm) @ self.lm_head.T).argmax(-1)

    # -- forward passes ------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, store, slot: int, tokens: torch.Tensor, start: int = 0) -> int:
        """Run one prompt (token ids [T]) at positions [start, start + T), write its K/V
        into ``slot``; the next token id. With ``start`` > 0 the slot already holds the
        first ``start`` tokens' K/V (a shared prefix) and the prompt attends to them too."""
        if not start:
            return self.prefill_batch(store, [slot], [tokens.tolist()])[0]
        count = tokens.numel()
        positions = torch.arange(start, start + count, device=self.device)
        # Token i sees keys [0, start + i]: causal, aligned to the last key.
        mask = torch.arange(start + count, device=self.device)[None] <= positions[:, None]
        rotary = self._rotary(positions)
        x = self.embedding[tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), rotary)
            store.write_prompt(index, slot, k, v, start)
            k, v = store.cached_kv(index, slot, start + count)
            attention = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
            x = self._block_end(layer, x, attention)
        return int(self._next_tokens(x[-1:])[0])

    @torch.inference_mode()
    def prefill_batch(self, store, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> List[int]:
        """Fresh prompts (token ids, one list each) of several slots in one pass: their
        tokens concatenated, each layer's K/V written for all of them in one scatter per
        tensor, causal attention within each prompt (the store's prefill_attention:
        FlashAttention-2 varlen on a GPU); the next token id of each."""
        lengths = np.array([len(p) for p in prompts])
        ends = np.cumsum(lengths)
        starts = ends - lengths
        host = np.empty((3, ends[-1]), dtype=np.int64)  # tokens, positions, slots: one copy to the device
        host[0] = np.concatenate(prompts)
        host[1] = np.arange(ends[-1]) - np.repeat(starts, lengths)
        host[2] = np.repeat(slots, lengths)
        tokens, positions, token_slots = torch.from_numpy(host).to(self.device).unbind()
        cu = torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32)).to(self.device)
        max_len = int(lengths.max())
        spans = list(zip(starts.tolist(), ends.tolist()))
        store.begin_prefill(slots, lengths.tolist())
        rotary = self._rotary(positions)
        x = self.embedding[tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), rotary)
            store.write_kv(index, token_slots, positions, k, v)
            attention = store.prefill_attention(index, q, k, v, cu, max_len, spans)
            x = self._block_end(layer, x, attention)
        return self._next_tokens(x[torch.as_tensor(ends - 1, device=self.device)]).tolist()

    @torch.inference_mode()
    def prefill_chunks(self, store, slots: Sequence[int], chunks: Sequence[Sequence[int]],
                       starts: Sequence[int]) -> List[int]:
        """Chunked prefill (vLLM's and SGLang's default for long prompts): chunk i (token ids)
        of slot ``slots[i]`` at positions [starts[i], starts[i] + len), whose slot already
        holds the K/V of the prompt's first ``starts[i]`` tokens from earlier chunks. Each
        chunk's K/V is written, then its queries attend to the whole cached prefix and to
        themselves, causally (the store's chunk_attention: a vkv store reads the prefix
        contiguously, a paged one through its page table). The next token id after each
        chunk (meaningful for a prompt's last chunk)."""
        lengths = np.array([len(c) for c in chunks])
        ends = np.cumsum(lengths)
        first = ends - lengths
        host = np.empty((3, ends[-1]), dtype=np.int64)  # tokens, positions, slots: one copy to the device
        host[0] = np.concatenate(chunks)
        host[1] = np.arange(ends[-1]) - np.repeat(first, lengths) + np.repeat(starts, lengths)
        host[2] = np.repeat(slots, lengths)
        tokens, positions, token_slots = torch.from_numpy(host).to(self.device).unbind()
        spans = list(zip(first.tolist(), ends.tolist()))
        store.begin_chunks(list(slots), list(starts), lengths.tolist())
        rotary = self._rotary(positions)
        x = self.embedding[tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), rotary)
            store.write_kv(index, token_slots, positions, k, v)
            attention = store.chunk_attention(index, q, k, v, spans)
            x = self._block_end(layer, x, attention)
        return self._next_tokens(x[torch.as_tensor(ends - 1, device=self.device)]).tolist()

    @torch.inference_mode()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of one whole sequence, no KV cache: a teacher-forced check."""
        positions = torch.arange(tokens.numel(), device=self.device)
        rotary = self._rotary(positions)
        x = self.embedding[tokens]
        for layer in self.layers:
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), rotary)
            attention = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            x = self._block_end(layer, x, attention)
        return (self._rms_norm(x, self.final_norm) @ self.lm_head.T).float()

    @torch.inference_mode()
    def decode(self, store, batch) -> torch.Tensor:
        """One token for each row of ``batch`` (the store's DecodeBatch): pure device work
        on the batch's tensors, so a CUDA graph can capture it."""
        return self._next_tokens(self.decode_hidden(store, batch))

    def decode_hidden(self, store, batch) -> torch.Tensor:
        """The last layer's hidden states [rows, hidden] of a decode step."""
        store.begin_decode(batch)
        rotary = self._rotary(batch.positions)
        x = self.embedding[batch.tokens]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms_norm(x, layer["norm1"]), rotary, batch.write_rows)
            store.write_kv(index, batch.slots, batch.positions, k, v)
            attention = store.decode_attention(index, batch, q)
            x = self._block_end(layer, x, attention)
        return x
