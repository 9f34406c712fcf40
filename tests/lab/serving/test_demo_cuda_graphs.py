"""On a CUDA device: the serving demo's decode step captured once into a CUDA graph and
replayed while requests come and go, vkv's step() maps pages and trim() unmaps them,
gives exactly what the same steps run eagerly on an independent store give. Run under compute-sanitizer
(scripts/gpu/all_tests.sh) it also shows that no replay touches memory that is not mapped.
The tensor-parallel demo captures its model's NCCL all-reduces into the graphs too."""

import pathlib
import random

import pytest
import torch

from conftest import needs_cuda
from lab.serving.decode_runner import DecodeRunner
from lab.serving.engine import Engine
from lab.stores.catalog import make_store
from lab.stores.kv_stores import VkvStore
from lab.serving.model import LlamaModel, ModelShape
from lab.serving.workload import make_trace

pytestmark = needs_cuda
ROOT = pathlib.Path(__file__).resolve().parents[3]

# 4 KiB of K/V per token over all layers: 512 tokens per 2 MiB page, so requests of a few
# hundred tokens cross pages. 8 query heads on 4 KV heads: FlashAttention's GQA decode path.
SHAPE = ModelShape("graph-test", num_layers=4, hidden=512, intermediate=1024, num_heads=8, num_kv_heads=4, vocab=1000)
MAX_CONTEXT = 2048
MAX_SLOTS = 12


def flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@pytest.mark.parametrize("kind", ["vkv-interleaved", "vkv-per-layer", "static", "paged-16"])
def test_graph_replay_equals_an_independent_eager_store_while_pages_come_and_go(kind):
    """The replay runs alone on its store (no eager pass there first: that would write the
    step's K/V itself, and hide a replay that writes them to the wrong place), and an
    independent store of the same kind, driven by the same calls, runs every step eagerly:
    a replay that writes a token's K/V anywhere else reads different keys from then on."""
    device = torch.device("cuda")
    rng = random.Random(1)
    model = LlamaModel(SHAPE, device, torch.bfloat16, MAX_CONTEXT, seed=3)
    stores = [make_store(kind, SHAPE, torch.bfloat16, device, MAX_CONTEXT, 256 << 20, MAX_SLOTS,
                         flex() if kind.startswith("paged") else None) for _ in range(2)]
    store, reference = stores
    runner = DecodeRunner(model, store, MAX_SLOTS, graphs=True)
    runner.capture()
    slot = reference.alloc()  # what capture() did on its store: the same slots and pages from here on
    assert reference.reserve({slot: 1})
    reference.free(slot)
    eager = DecodeRunner(model, reference, MAX_SLOTS, graphs=False)
    addresses = [t.data_ptr() for t in getattr(store, "keys", getattr(store, "k_pools", []))]
    running = {}  # slot -> [tokens in the cache once the next is written, next token]
    compared = 0
    for iteration in range(40):
        # Requests leave and arrive with prompts of 3 to 600 tokens (pages mapped for them),
        # survivors grow by a token per iteration (some across a page boundary), and every
        # 10 iterations trim() unmaps the pages the freed slots kept.
        for slot in [s for s in running if rng.random() < 0.15]:
            del running[slot]
            for each in stores:
                each.free(slot)
        if iteration % 10 == 9 and isinstance(store, VkvStore):
            for each in stores:
                each.cache.trim()  # unmaps the pages freed slots kept
        arrivals = []
        while len(running) + len(arrivals) < MAX_SLOTS and rng.random() < 0.5:
            slot = store.alloc()
            assert reference.alloc() == slot
            arrivals.append((slot, [rng.randrange(SHAPE.vocab) for _ in range(rng.choice((3, 100, 505, 600)))]))
        lens = {slot: n for slot, (n, _) in running.items()}
        lens.update({slot: len(prompt) + 1 for slot, prompt in arrivals})
        assert store.reserve(lens) and reference.reserve(lens)
        if arrivals:
            firsts = model.prefill_batch(store, [s for s, _ in arrivals], [p for _, p in arrivals])
            assert model.prefill_batch(reference, [s for s, _ in arrivals], [p for _, p in arrivals]) == firsts
        for (slot, prompt), first in zip(arrivals, firsts if arrivals else []):
            running[slot] = [len(prompt) + 1, first]
        slots = sorted(running)
        if not slots:
            continue
        tokens, seq_lens = [running[s][1] for s in slots], [running[s][0] for s in slots]
        bucket = runner.bucket(len(slots))
        runner.load(bucket, slots, tokens, seq_lens)
        replay_tokens, replay_hidden = runner.replay(bucket)
        eager.load(bucket, slots, tokens, seq_lens)
        eager_tokens, eager_hidden = eager.forward(bucket)
        rows = len(slots)
        assert torch.equal(replay_hidden[:rows], eager_hidden[:rows]), f"iteration {iteration}, {rows} rows"
        assert torch.equal(replay_tokens[:rows], eager_tokens[:rows])
        compared += 1
        for slot, token in zip(slots, replay_tokens[:rows].tolist()):
            running[slot][0] += 1
            running[slot][1] = token
    assert compared >= 30
    assert [t.data_ptr() for t in getattr(store, "keys", getattr(store, "k_pools", []))] == addresses
    if isinstance(store, VkvStore):
        backend = store.cache.stats()["backend"]
        assert backend["map"]["units"] > 0 and backend["unmap"]["units"] > 0, backend
    runner.release()
    for each in stores:
        each.close()


class WaitingRunner(DecodeRunner):
    """Reads every step's tokens on the host before launching the next (no device-side feed)."""

    def launch(self, slots, tokens, lens, feed=None):
        if feed is not None and any(f >= 0 for f in feed):
            previous = self.wait(self._previous)
            tokens = [previous[f] if f >= 0 else t for t, f in zip(tokens, feed)]
        return super().launch(slots, tokens, lens)


@pytest.mark.parametrize("kind", ["vkv-interleaved", "paged-16"])
def test_steps_launched_ahead_generate_what_steps_waited_for_do(kind):
    """The engine launches step i+1 before reading step i's tokens (fed on the device):
    the tokens equal those of an engine that waits for every step."""
    import copy
    import math

    device = torch.device("cuda")
    trace = make_trace(24, math.inf, 512, SHAPE.vocab, seed=4, scale=0.3)
    outputs = []
    for runner_type in (DecodeRunner, WaitingRunner):
        model = LlamaModel(SHAPE, device, torch.bfloat16, MAX_CONTEXT, seed=3)
        store = make_store(kind, SHAPE, torch.bfloat16, device, MAX_CONTEXT, 256 << 20, MAX_SLOTS,
                           flex() if kind.startswith("paged") else None)
        engine = Engine(model, store, max_prefill_tokens=1024, cuda_graphs=True)
        engine.decoder = runner_type(model, store, store.max_slots, graphs=True)
        result = engine.run(copy.deepcopy(trace), show_progress=False)
        assert all(len(r.tokens) == r.output_len for r in result.requests)
        outputs.append([r.tokens for r in result.requests])
        engine.decoder.release()
        store.close()
    assert outputs[0] == outputs[1]


def test_the_tensor_parallel_demo_replays_its_decode_and_all_reduces_from_cuda_graphs(tmp_path):
    """One rank over NCCL (what one GPU can check): the sharded model's all-reduces are
    captured with the decode step, and the run agrees through shared memory."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "lab.serving.tp",
               "--device", "cuda", "--model", "tiny", "--requests", "8", "--length-scale", "0.1",
               "--kv-budget-mib", "256", "--teacher-forced", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)  # where -m finds lab
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "decode CUDA graphs" in done.stdout and "ranks agree on every token: True" in done.stdout, done.stdout
    assert "through shared_memory" in done.stdout, done.stdout
