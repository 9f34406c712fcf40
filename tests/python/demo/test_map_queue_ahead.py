"""The demo engine maps the waiting queue ahead on a vkv store: the requests the next
iteration admits get their slots and their prompts announced (expect) before this
iteration's forward, so the mapper maps their pages while it runs and their admission's
step() finds them mapped; the same requests are served with the same tokens."""

import copy

import pytest
import torch

from vkv.demo.engine import Engine
from vkv.demo.kv_stores import make_store
from vkv.demo.model import SHAPES, LlamaModel
from vkv.demo.workload import Request

SHAPE = SHAPES["tiny"]
MAX_CONTEXT = 512
CPU = torch.device("cpu")


def store_of(kind, max_slots=16):
    return make_store(kind, SHAPE, torch.float32, CPU, MAX_CONTEXT, 16 << 20, max_slots, None, page_size=16 << 10)


def trace(count=12):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(60, 120, (count,), generator=generator).tolist()
    return [Request(id=i, arrival=0.0, prompt_len=n, output_len=4,
                    prompt=torch.randint(0, SHAPE.vocab, (n,), generator=generator).tolist())
            for i, n in enumerate(lengths)]


def serve(kind, map_queue_ahead, watch):
    """Serves the trace (3 prompts an iteration at most); with ``watch``, the mapper gets each
    forward's time (it maps what it would while the pass runs), and every admission's step()
    records, for each slot it gives a prompt, the forwards run before it and whether that
    prompt's pages were mapped before the step."""
    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    store = store_of(kind)
    engine = Engine(model, store, max_prefill_tokens=360, **({} if map_queue_ahead else {"map_queue_ahead": False}))
    admissions = []  # (forwards before it, its pages were mapped before its step)
    forwards = []
    if watch:
        prefill_batch, reserve = model.prefill_batch, store.reserve

        def prefill_in_which_the_mapper_runs(*args):
            forwards.append(1)
            store.cache.map_ahead_now()
            return prefill_batch(*args)

        def recording_reserve(lens):
            stepped = store.cache.seq_lens()
            for slot, tokens in lens.items():
                if stepped[slot] == 0 and tokens > 0:  # a prompt admitted by this step
                    pages = -(-tokens // store.cache.tokens_per_page)
                    admissions.append((len(forwards), store.cache.mapped_pages(slot) >= pages))
            return reserve(lens)

        model.prefill_batch = prefill_in_which_the_mapper_runs
        store.reserve = recording_reserve
    result = engine.run(copy.deepcopy(trace()), show_progress=False)
    free = store.cache.num_free_slots if hasattr(store, "cache") else None
    store.close()
    return result, admissions, free


def test_the_next_iterations_prompts_are_mapped_before_their_step():
    result, admissions, free = serve("vkv-interleaved", True, watch=True)
    assert result.rejected == 0 and result.preemptions == 0
    first = [ready for iteration, ready in admissions if iteration == 0]
    later = [ready for iteration, ready in admissions if iteration > 0]
    assert len(first) == 3 and len(later) == 9  # 3 prompts an iteration: 3 admitted before any forward
    assert all(later)  # every prompt admitted after a forward found its pages mapped
    assert free == 16  # the slots held for the queue all went to their requests, then back


def test_mapping_the_queue_ahead_serves_the_same_requests_with_the_same_tokens():
    ahead, _, _ = serve("vkv-interleaved", True, watch=False)
    plain, _, _ = serve("vkv-interleaved", False, watch=False)
    paged, _, _ = serve("paged-16", True, watch=False)  # maps nothing ahead: the option changes nothing
    tokens = [r.tokens for r in plain.requests]
    assert [r.tokens for r in ahead.requests] == tokens == [r.tokens for r in paged.requests]
    assert ahead.iterations == plain.iterations


@pytest.mark.parametrize("kind", ["vkv-interleaved", "paged-16"])
def test_only_a_store_that_maps_ahead_holds_slots_for_the_queue(kind):
    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    store = store_of(kind)
    assert Engine(model, store, 360).map_queue_ahead == (kind == "vkv-interleaved")
    assert not Engine(model, store, 360, map_queue_ahead=False).map_queue_ahead
    assert not Engine(model, store, 360, chunked_prefill=True).map_queue_ahead  # announced at admission there
    store.close()
