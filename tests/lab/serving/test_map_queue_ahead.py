"""The demo engine maps the waiting queue ahead on a vkv store: the requests the next
iteration admits get their slots and their prompts announced (expect) before this
iteration's forward, so the mapper maps their pages while it runs and their admission's
step() finds them mapped, prompts prefilled whole or in chunks; the same requests are served
with the same tokens."""

import copy

import pytest
import torch

from lab.serving.engine import Engine
from lab.stores.catalog import make_store
from lab.serving.model import SHAPES, LlamaModel
from lab.serving.workload import Request

SHAPE = SHAPES["tiny"]
MAX_CONTEXT = 512
CPU = torch.device("cpu")


def store_of(kind, max_slots=16):
    return make_store(kind, SHAPE, torch.float32, CPU, MAX_CONTEXT, 16 << 20, max_slots, None, page_size=16 << 10)


def trace(count=12, shortest=60, longest=120):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest, (count,), generator=generator).tolist()
    return [Request(id=i, arrival=0.0, prompt_len=n, output_len=4,
                    prompt=torch.randint(0, SHAPE.vocab, (n,), generator=generator).tolist())
            for i, n in enumerate(lengths)]


def serve(kind, map_queue_ahead, watch, chunk=0, requests=None):
    """Serves ``requests`` (default: trace(), 3 prompts an iteration at most); with ``watch``,
    the mapper gets each forward's time (it maps what it would while the pass runs), and every
    admission's step() records, in admission order, the forwards run before it and the pages
    mapped in the slot it gives a prompt before the step."""
    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    store = store_of(kind)
    options = {"chunked_prefill": True} if chunk else {}
    if not map_queue_ahead:
        options["map_queue_ahead"] = False
    engine = Engine(model, store, max_prefill_tokens=chunk or 360, **options)
    admissions = []  # (forwards before it, its pages were mapped before its step)
    forwards = []
    if watch:
        prefill_batch, prefill_chunks, reserve = model.prefill_batch, model.prefill_chunks, store.reserve

        def prefill_in_which_the_mapper_runs(*args):
            forwards.append(1)
            store.cache.map_ahead_now()
            return prefill_batch(*args)

        def chunks_in_which_the_mapper_runs(*args):
            forwards.append(1)
            store.cache.map_ahead_now()
            return prefill_chunks(*args)

        def recording_reserve(lens):
            stepped = store.cache.seq_lens()
            for slot, tokens in lens.items():
                if stepped[slot] == 0 and tokens > 0:  # a prompt admitted by this step
                    admissions.append((len(forwards), store.cache.mapped_pages(slot)))
            return reserve(lens)

        model.prefill_batch = prefill_in_which_the_mapper_runs
        model.prefill_chunks = chunks_in_which_the_mapper_runs
        store.reserve = recording_reserve
    result = engine.run(copy.deepcopy(requests or trace()), show_progress=False)
    free = store.cache.num_free_slots if hasattr(store, "cache") else None
    store.close()
    return result, admissions, free


def ready(admissions, requests):
    """Per admission (in the requests' order: all arrive at once, none is preempted): the
    forwards before it and whether its whole prompt's pages were mapped before its step."""
    tokens_per_page = (16 << 10) // (2 * SHAPE.num_layers * SHAPE.num_kv_heads * SHAPE.head_dim * 4)  # 8
    return [(forwards, mapped >= -(-r.prompt_len // tokens_per_page))
            for (forwards, mapped), r in zip(admissions, requests)]


def test_the_next_iterations_prompts_are_mapped_before_their_step():
    result, admissions, free = serve("vkv-interleaved", True, watch=True)
    assert result.rejected == 0 and result.preemptions == 0
    admissions = ready(admissions, trace())
    first = [ready for iteration, ready in admissions if iteration == 0]
    later = [ready for iteration, ready in admissions if iteration > 0]
    assert len(first) == 3 and len(later) == 9  # 3 prompts an iteration: 3 admitted before any forward
    assert all(later)  # every prompt admitted after a forward found its pages mapped
    assert free == 16  # the slots held for the queue all went to their requests, then back


def test_with_chunked_prefill_the_next_prompts_whole_prompt_is_mapped_before_their_step():
    """128 tokens an iteration, prompts of 200-300 tokens: a prompt is admitted where the one
    started before it leaves some of the budget; by its first step, its whole prompt is mapped
    (announced an iteration ahead), not only its first chunk."""
    requests = trace(shortest=200, longest=300)
    result, admissions, free = serve("vkv-interleaved", True, watch=True, chunk=128, requests=requests)
    assert result.rejected == 0 and result.preemptions == 0
    later = [ready for forwards, ready in ready(admissions, requests) if forwards > 0]
    assert len(admissions) == 12 and len(later) == 11
    assert all(later)
    assert free == 16


def test_mapping_the_queue_ahead_serves_the_same_requests_with_the_same_tokens():
    ahead, _, _ = serve("vkv-interleaved", True, watch=False)
    plain, _, _ = serve("vkv-interleaved", False, watch=False)
    paged, _, _ = serve("paged-16", True, watch=False)  # maps nothing ahead: the option changes nothing
    tokens = [r.tokens for r in plain.requests]
    assert [r.tokens for r in ahead.requests] == tokens == [r.tokens for r in paged.requests]
    assert ahead.iterations == plain.iterations
    chunked_ahead, _, _ = serve("vkv-interleaved", True, watch=False, chunk=128)
    chunked_plain, _, _ = serve("vkv-interleaved", False, watch=False, chunk=128)
    assert [r.tokens for r in chunked_ahead.requests] == [r.tokens for r in chunked_plain.requests]
    assert chunked_ahead.iterations == chunked_plain.iterations


@pytest.mark.parametrize("kind", ["vkv-interleaved", "paged-16"])
def test_only_a_store_that_maps_ahead_holds_slots_for_the_queue(kind):
    model = LlamaModel(SHAPE, CPU, torch.float32, MAX_CONTEXT)
    store = store_of(kind)
    assert Engine(model, store, 360).map_queue_ahead == (kind == "vkv-interleaved")
    assert not Engine(model, store, 360, map_queue_ahead=False).map_queue_ahead
    assert Engine(model, store, 360, chunked_prefill=True).map_queue_ahead == (kind == "vkv-interleaved")
    store.close()
