"""``python -m vkv.demo``: how many requests fit in the same KV memory when pages are mapped
on demand.

A queue of ShareGPT-like requests (seeded; more than any cache holds, as on a busy server)
is served for the same number of iterations by the same continuous-batching loop, in the
same KV memory, twice:

  static  each request reserves ``max_context_len`` tokens when admitted, in a
          ``[slots, max_context_len, ...]`` tensor allocated up front (engines without
          paging): the memory holds ``memory / (max_context_len * token_bytes)`` requests
  vkv     a ``vkv.KVCache`` with that ``memory_budget``: each request's tokens in one
          contiguous range of virtual memory, pages mapped by ``step()`` as it grows; a
          request is admitted while its prompt's pages fit, and the newest one is preempted
          (recomputed later) when a decode step finds no page

Every iteration writes each running request's new keys and values through the cache's
tensors, every layer; each finished request's attention (torch's SDPA over its keys and
values) is compared between the two caches. The table gives the requests held at once and
the tokens generated per iteration: the same on a CPU as on a GPU, because the queue, the
tokens a page holds (16) and the token budget are the same on both (a CPU gets a smaller KV
shape: fewer bytes a token). A decode iteration on a GPU takes about as long for 100
requests as for 8, so tokens per iteration is throughput there. The full comparison, with a
model, paged caches and FlashInfer, runs from a checkout: ``python -m lab.serving``.

    python -m vkv.demo                     # the GPU if there is one, else the host backend
    python -m vkv.demo --device cpu --iterations 500
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

import vkv

MEAN_PROMPT, MEAN_OUTPUT = 161, 338  # ShareGPT's mean prompt and output lengths, in tokens
MAX_CONTEXT = 8192
STATIC_SLOTS = 8  # the memory: 8 requests of MAX_CONTEXT tokens, 65,536 tokens either way
VKV_SLOTS = 256   # more than the memory holds: memory, not slots, limits vkv


@dataclass(frozen=True)
class Shape:
    """The KV geometry; ``page_size`` holds 16 tokens on both."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int

    @property
    def token_bytes(self) -> int:  # every layer's key and value
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


GPU_SHAPE = Shape("Llama-3-8B's KV shape (32 layers, 8 KV heads of 128, bf16)", 32, 8, 128, torch.bfloat16, 2 << 20)
CPU_SHAPE = Shape("a CPU-sized KV shape (4 layers, 2 KV heads of 64, fp32)", 4, 2, 64, torch.float32, 64 << 10)


@dataclass
class Request:
    id: int
    prompt_len: int
    output_len: int
    generated: int = 0
    slot: int = -1

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generated


@dataclass
class Served:
    running: List[int] = field(default_factory=list)  # requests running, per iteration
    tokens: int = 0                                   # tokens generated
    finished: int = 0
    preemptions: int = 0
    peak_bytes: int = 0


def make_queue(count: int, seed: int) -> List[Request]:
    """Lognormal lengths (sigma 1) with ShareGPT's means, each at most half the context."""
    rng = np.random.default_rng(seed)

    def lengths(mean: int, low: int) -> np.ndarray:
        return np.clip(np.round(rng.lognormal(math.log(mean) - 0.5, 1.0, count)), low, MAX_CONTEXT // 2).astype(int)

    return [Request(i, int(p), int(o)) for i, (p, o) in enumerate(zip(lengths(MEAN_PROMPT, 4), lengths(MEAN_OUTPUT, 2)))]


class KvWriter:
    """Writes tokens' keys and values through a cache's tensors: values that depend only on
    the request and the position, so that both caches hold the same bytes."""

    def __init__(self, shape: Shape, device: torch.device, keys: Sequence[torch.Tensor],
                 values: Sequence[torch.Tensor]) -> None:
        base = torch.randn(shape.num_layers, 2, shape.num_kv_heads, shape.head_dim,
                           generator=torch.Generator().manual_seed(0))
        self.base = base.to(device, shape.dtype)
        self.keys, self.values, self.device, self.dtype = keys, values, device, shape.dtype

    def write(self, slots: Sequence[int], ids: Sequence[int], positions: Sequence[int]) -> None:
        slots_t, ids_t, positions_t = (torch.as_tensor(x, device=self.device) for x in (slots, ids, positions))
        scale = ((ids_t * 7919 + positions_t * 104729) % 997).to(self.dtype) / 997 + 0.5
        kv = self.base[None] * scale[:, None, None, None, None]  # [tokens, layers, 2, heads, dim]
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            keys[slots_t, positions_t] = kv[:, layer, 0]
            values[slots_t, positions_t] = kv[:, layer, 1]

    def attention(self, slot: int, length: int) -> torch.Tensor:
        """Layer 0's attention of one query over a request's keys and values (SDPA; copied
        to [heads, tokens, dim] first, the layout SDPA takes)."""
        keys = self.keys[0][slot, :length].transpose(0, 1).contiguous()
        values = self.values[0][slot, :length].transpose(0, 1).contiguous()
        query = self.base[0, 0, :, None, :]  # [heads, 1, dim]
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values).float().cpu()


def serve(queue: Sequence[Request], cache: Optional[vkv.KVCache], shape: Shape, device: torch.device,
          iterations: int) -> tuple:
    """``iterations`` iterations of ``queue`` on ``cache`` (vkv), or on a static reservation of
    STATIC_SLOTS requests when None. Returns (Served, each finished request's attention)."""
    if cache is None:
        slots = STATIC_SLOTS
        whole = torch.zeros(slots, MAX_CONTEXT, shape.num_layers, 2, shape.num_kv_heads, shape.head_dim,
                            dtype=shape.dtype, device=device)  # the strides of vkv's interleaved layout
        keys = [whole[:, :, layer, 0] for layer in range(shape.num_layers)]
        values = [whole[:, :, layer, 1] for layer in range(shape.num_layers)]
        free = list(range(slots))
    else:
        slots = cache.max_batch_size
        keys, values = cache.kv_tensors()
    writer = KvWriter(shape, device, keys, values)
    waiting = [Request(r.id, r.prompt_len, r.output_len) for r in queue]
    running: List[Request] = []
    outputs: Dict[int, torch.Tensor] = {}
    served = Served()
    seq_lens = np.zeros(slots, dtype=np.int64)

    def release(request: Request) -> None:
        seq_lens[request.slot] = 0
        if cache is None:
            free.append(request.slot)
        else:
            cache.free_reqid(request.slot)

    def fits(request: Request) -> bool:
        """vkv: its prompt's pages fit with a page to spare for each running request (the
        next tokens of each), as a serving engine keeps a watermark."""
        if cache is None:
            return True
        pages = -(-request.seq_len // cache.tokens_per_page) + len(running) + 1
        return cache.stats()["pages_in_use"] + pages <= budget_pages

    budget_pages = 0 if cache is None else STATIC_SLOTS * MAX_CONTEXT * shape.token_bytes // shape.page_size
    for _ in range(iterations):
        while waiting and len(running) < slots and fits(waiting[0]):  # admission, first come first served
            request = waiting[0]
            request.slot = free.pop() if cache is None else cache.alloc_reqid()
            seq_lens[request.slot] = request.seq_len
            if cache is not None:
                try:
                    cache.step(seq_lens)  # its prompt's pages, or none
                except vkv.OutOfMemory:
                    release(request)
                    break
            waiting.pop(0)
            running.append(request)
            count = request.seq_len  # its prompt, and what it generated before a preemption
            writer.write([request.slot] * count, [request.id] * count, range(count))
        if not running:
            break
        for request in running:  # this iteration's token
            request.generated += 1
            seq_lens[request.slot] = request.seq_len
        while cache is not None:
            try:
                cache.step(seq_lens)
                break
            except vkv.OutOfMemory:  # preempt the newest: it starts again from the queue's head
                victim = running.pop()
                release(victim)
                waiting.insert(0, Request(victim.id, victim.prompt_len, victim.output_len, victim.generated - 1))
                served.preemptions += 1
        writer.write([r.slot for r in running], [r.id for r in running], [r.seq_len - 1 for r in running])
        served.running.append(len(running))
        served.tokens += len(running)
        in_use = STATIC_SLOTS * MAX_CONTEXT * shape.token_bytes if cache is None else \
            cache.stats()["pages_in_use"] * shape.page_size
        served.peak_bytes = max(served.peak_bytes, in_use)
        for request in [r for r in running if r.generated == r.output_len]:
            outputs[request.id] = writer.attention(request.slot, request.seq_len)
            running.remove(request)
            release(request)
            served.finished += 1
    return served, outputs


def size(count: int) -> str:
    return f"{count / (1 << 30):.2f} GiB" if count >= 1 << 30 else f"{count / (1 << 20):.0f} MiB"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vkv.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto (default): the GPU where vkv and torch see one, else the host backend")
    parser.add_argument("--iterations", type=int, default=1000, help="iterations on each cache (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="the queue's seed (default 0)")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations = {args.iterations} must be at least 1")
    on_gpu = args.device == "cuda" or (args.device == "auto" and vkv.cuda_available() and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    shape = GPU_SHAPE if on_gpu else CPU_SHAPE
    if not on_gpu:
        torch.set_num_threads(1)  # small tensor ops: threads' barriers cost more than they save
    memory = STATIC_SLOTS * MAX_CONTEXT * shape.token_bytes
    queue = make_queue(4 * args.iterations, args.seed)  # more than either cache finishes
    print(f"{args.iterations} iterations of a queue of ShareGPT-like requests (prompts {MEAN_PROMPT} and outputs "
          f"{MEAN_OUTPUT} tokens on average, contexts up to {MAX_CONTEXT}) in {size(memory)} of KV memory on {device}: "
          f"{shape.name}, {shape.token_bytes >> 10} KiB a token\n")
    start = time.perf_counter()
    static, expected = serve(queue, None, shape, device, args.iterations)
    if on_gpu:
        torch.cuda.empty_cache()  # the static tensor's memory back to the device, for vkv's pages
    with vkv.KVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype, max_batch_size=VKV_SLOTS,
                     max_context_len=MAX_CONTEXT, device=str(device), memory_budget=memory,
                     page_size=shape.page_size) as cache:
        ours, outputs = serve(queue, cache, shape, device, args.iterations)
    rows = [("static reservation", static, f"{size(static.peak_bytes)} reserved up front"),
            ("vkv", ours, f"{size(ours.peak_bytes)} mapped at the peak")]
    print(f"{'':<19} {'requests at once':>16} {'finished':>9} {'preempted':>10}  KV memory")
    print(f"{'':<19} {'mean':>9} {'max':>6}")
    for name, served, memory_note in rows:
        print(f"{name:<19} {served.tokens / max(len(served.running), 1):>9.1f} {max(served.running, default=0):>6} "
              f"{served.finished:>9} {served.preemptions:>10}  {memory_note}")
    both = sorted(set(expected) & set(outputs))
    same = all(torch.equal(outputs[i], expected[i]) for i in both)
    gain = ours.tokens / max(static.tokens, 1)
    print(f"\nIn the same memory vkv ran {gain:.1f}x as many requests at once (each iteration generates a token for "
          f"each), mapping pages as they grew.")
    print(f"Attention (torch's SDPA) over the keys and values of the {len(both)} requests both finished: "
          f"{'the same on both caches' if same else 'DIFFERENT'}.")
    print(f"{time.perf_counter() - start:.1f} s on this machine; the lab compares vkv with paged caches and "
          f"FlashInfer, a model included: python -m lab.serving, from a checkout (lab/README.md).")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
