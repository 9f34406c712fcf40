"""VkvCache: vkv as a transformers Cache, checked token for token against DynamicCache.

A seeded random-weight tiny Llama (no downloads). Skips without transformers (a test extra).
"""

import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

import vkv  # noqa: E402
from conftest import DEVICES  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from vkv.integrations.transformers import VkvCache, cache_kwarg  # noqa: E402

CACHE = cache_kwarg()  # "cache" from transformers 5.24 on, "past_key_values" before
PROMPT = 12
NEW = 16


def tiny_llama(device="cpu", dtype=torch.float32, layers=2):
    """A Llama of 2 layers, 4 query and 2 KV heads of 16; large initial weights make the
    logits peaked, so greedy picks are far from ties."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # every row generates max_new_tokens
    return model


@pytest.fixture(params=DEVICES)
def model(request):
    if request.param == "cpu":
        return tiny_llama()
    return tiny_llama("cuda", torch.bfloat16)


def prompts(model, rows=3, padded=False, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    if padded:  # left padding: rows of 12, 8 and 10 tokens
        for row, pad in enumerate([0, 4, 2][:rows]):
            mask[row, :pad] = 0
    ids[mask == 0] = 0
    return ids.to(model.device), mask.to(model.device)


def vkv_cache(model, **options):
    options.setdefault("max_batch_size", 16)
    options.setdefault("max_context_len", 256)
    if model.device.type == "cpu":
        options.setdefault("page_size", 64 << 10)
    return VkvCache.from_model(model, **options)


def generate(model, ids, mask, cache=None, **options):
    options.setdefault("max_new_tokens", NEW)
    options.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **{CACHE: cache}, **options)


@pytest.mark.parametrize("padded", [False, True], ids=["equal_prompts", "left_padded"])
def test_greedy_tokens_equal_dynamic_cache(model, padded):
    ids, mask = prompts(model, padded=padded)
    reference = generate(model, ids, mask, DynamicCache(config=model.config))
    with vkv_cache(model) as cache:
        tokens = generate(model, ids, mask, cache)
        assert cache.get_seq_length() == PROMPT + NEW - 1
        assert not cache.copies_history
    assert torch.equal(tokens, reference)


def test_beam_search_equals_dynamic_cache(model):
    ids, mask = prompts(model, padded=True)
    reference = generate(model, ids, mask, num_beams=3, num_return_sequences=2)
    with vkv_cache(model, max_batch_size=18) as cache:  # 9 beams, and 9 more slots to reorder into
        tokens = generate(model, ids, mask, cache, num_beams=3, num_return_sequences=2)
        assert not cache.copies_history  # each reorder found 9 adjacent slots
    assert torch.equal(tokens, reference)


def test_beam_search_without_spare_slots_reorders_in_place():
    model = tiny_llama()
    ids, mask = prompts(model, padded=True)
    reference = generate(model, ids, mask, num_beams=3)
    with vkv_cache(model, max_batch_size=9) as cache:
        tokens = generate(model, ids, mask, cache, num_beams=3)
        assert cache.slots == list(range(9))
    assert torch.equal(tokens, reference)


def decode_loop(model, ids, mask, cache, steps=NEW, crop_at=None, crop_tokens=3):
    """A hand-written prefill/decode loop: greedy tokens and every step's logits; at step
    `crop_at`, drop the last `crop_tokens` tokens and go on from there (a rollback)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens, logits, sequence = [], [], ids
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE: cache}, use_cache=True)
        for step in range(steps):
            logits.append(out.logits[:, -1].float())
            next_token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(next_token)
            sequence = torch.cat([sequence, next_token], dim=-1)
            mask = torch.cat([mask, torch.ones_like(next_token)], dim=-1)
            if step == crop_at:  # the cache holds every token of `sequence` but the last
                cache.crop(-crop_tokens)
                kept = sequence.shape[1] - 1 - crop_tokens
                sequence, mask = sequence[:, :kept + 1], mask[:, :kept + 1]
                next_token = sequence[:, -1:]  # fed again, at its own position
            positions = (mask.sum(-1, keepdim=True) - 1)
            out = model(input_ids=next_token, attention_mask=mask, position_ids=positions, **{CACHE: cache},
                        use_cache=True)
    return torch.cat(tokens, dim=-1), torch.stack(logits)


@pytest.mark.parametrize("crop_at", [None, 6], ids=["plain", "with_crop"])
def test_a_hand_written_loop_equals_dynamic_cache_logit_for_logit(model, crop_at):
    ids, mask = prompts(model, padded=True)
    reference = decode_loop(model, ids, mask, DynamicCache(config=model.config), crop_at=crop_at)
    with vkv_cache(model) as cache:
        tokens, logits = decode_loop(model, ids, mask, cache, crop_at=crop_at)
    assert torch.equal(tokens, reference[0])
    assert torch.equal(logits, reference[1])


def test_history_is_a_view_of_the_slots_when_they_are_adjacent():
    model = tiny_llama()
    ids, mask = prompts(model)
    with vkv_cache(model) as cache:
        generate(model, ids, mask, cache, max_new_tokens=2)
        base = cache.kv_cache.key(0)
        first = cache.slots[0]
        keys = cache.layers[0].keys
        assert keys.shape == (3, 2, PROMPT + 1, 16)
        assert keys.data_ptr() == base[first].data_ptr()  # no copy: the vkv slot itself
        assert keys.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_scattered_slots_still_give_the_same_tokens():
    model = tiny_llama()
    ids, mask = prompts(model, padded=True)
    reference = generate(model, ids, mask)
    with vkv_cache(model, max_batch_size=6) as cache:
        taken = cache.kv_cache.alloc_reqids(6)
        for slot in (0, 2, 4):  # free slots 0, 2 and 4: no two adjacent
            cache.kv_cache.free_reqid(slot)
        tokens = generate(model, ids, mask, cache)
        assert cache.slots == [0, 2, 4] and cache.copies_history
        for slot in (1, 3, 5):
            cache.kv_cache.free_reqid(slot)
        del taken
    assert torch.equal(tokens, reference)


def test_select_and_repeat_rows_equal_dynamic_cache():
    model = tiny_llama()
    ids, mask = prompts(model, padded=True)
    caches = [DynamicCache(config=model.config), vkv_cache(model)]
    outputs = []
    for cache in caches:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{CACHE: cache}, use_cache=True)
            cache.batch_repeat_interleave(2)
            cache.batch_select_indices(torch.tensor([5, 0, 2]))
            rows = torch.tensor([2, 0, 1])
            next_ids = torch.full((3, 1), 7)
            next_mask = torch.cat([mask[rows], torch.ones(3, 1, dtype=mask.dtype)], dim=-1)
            out = model(input_ids=next_ids, attention_mask=next_mask, position_ids=next_mask.sum(-1, keepdim=True) - 1,
                        **{CACHE: cache}, use_cache=True)
        outputs.append(out.logits)
    assert torch.equal(outputs[0], outputs[1])
    caches[1].close()


def test_generations_sharing_one_kv_cache_each_equal_their_own_run():
    model = tiny_llama()
    shared = vkv.KVCache(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, max_batch_size=8,
                         max_context_len=256, device="cpu", page_size=64 << 10)
    batches = [prompts(model, rows=3, padded=True, seed=1), prompts(model, rows=2, padded=True, seed=2)]
    references = [decode_loop(model, ids, mask, DynamicCache(config=model.config)) for ids, mask in batches]

    # Interleaved on one thread: one generation's steps never disturb the other's slots.
    caches = [VkvCache(shared), VkvCache(shared)]
    loops = [decode_loop_steps(model, ids, mask, cache) for (ids, mask), cache in zip(batches, caches)]
    results = [None, None]
    while any(result is None for result in results):
        for i, loop in enumerate(loops):
            if results[i] is None:
                try:
                    next(loop)
                except StopIteration as done:
                    results[i] = done.value
    assert set(caches[0].slots).isdisjoint(caches[1].slots)
    for result, reference in zip(results, references):
        assert torch.equal(result[0], reference[0]) and torch.equal(result[1], reference[1])
    for cache in caches:
        cache.reset()

    # And on two threads at once.
    results = [None, None]

    def run(i):
        results[i] = decode_loop(model, *batches[i], caches[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result, reference in zip(results, references):
        assert torch.equal(result[0], reference[0]) and torch.equal(result[1], reference[1])
    for cache in caches:
        cache.close()  # not theirs to close: the shared KVCache stays open
    assert not shared.closed and shared.num_free_slots == 8
    assert shared.stats()["pages_in_use"] == 0
    shared.close()


def decode_loop_steps(model, ids, mask, cache, steps=NEW):
    """decode_loop as a generator that yields after every forward pass."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens, logits = [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{CACHE: cache}, use_cache=True)
        yield
        for _ in range(steps):
            logits.append(out.logits[:, -1].float())
            next_token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(next_token)
            mask = torch.cat([mask, torch.ones_like(next_token)], dim=-1)
            out = model(input_ids=next_token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                        **{CACHE: cache}, use_cache=True)
            yield
    return torch.cat(tokens, dim=-1), torch.stack(logits)


def test_memory_goes_back_after_use():
    model = tiny_llama()
    ids, mask = prompts(model, padded=True)
    cache = vkv_cache(model)
    kv = cache.kv_cache
    generate(model, ids, mask, cache, num_beams=2)
    assert kv.stats()["pages_in_use"] > 0
    cache.reset()
    assert kv.num_free_slots == 16 and kv.stats()["pages_in_use"] == 0 and cache.get_seq_length() == 0
    tokens = generate(model, ids[:1], mask[:1], cache)  # a new generation, another batch size
    assert torch.equal(tokens, generate(model, ids[:1], mask[:1]))
    cache.close()
    assert kv.closed


def test_errors_speak_transformers_names():
    model = tiny_llama()
    ids, mask = prompts(model)
    with vkv_cache(model, dtype=torch.float16) as cache:
        with pytest.raises(ValueError, match="key_states has dtype torch.float32 but the vkv.KVCache holds torch.float16"):
            generate(model, ids, mask, cache)
    with vkv_cache(model, max_context_len=20) as cache:
        with pytest.raises(ValueError, match="max_context_len = 20"):
            generate(model, ids, mask, cache, max_new_tokens=16)
    with vkv_cache(model, page_size=4096, memory_budget=4 * 4096) as cache:  # 8 tokens a page, 3 rows
        with pytest.raises(vkv.OutOfMemory, match="cannot back 3 rows of 12 tokens: 2 more pages"):
            generate(model, ids, mask, cache)
    with vkv_cache(model, max_batch_size=2) as cache:
        with pytest.raises(ValueError, match="the batch has 3 rows but the vkv.KVCache has 2 free slots"):
            generate(model, ids, mask, cache)
    with vkv_cache(model) as cache:
        generate(model, ids, mask, cache, max_new_tokens=1)
        with pytest.raises(ValueError, match="key_states has batch size 2 but this VkvCache holds 3 rows"):
            model(input_ids=ids[:2], **{CACHE: cache}, use_cache=True)
    sliding = transformers.MistralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_attention"):
        VkvCache.from_config(sliding, max_batch_size=2, max_context_len=64, device="cpu")


def test_crop_steps_the_slots_back_and_keeps_their_pages():
    model = tiny_llama()
    ids, mask = prompts(model)
    with vkv_cache(model, page_size=4096, background_mapping=False) as cache:  # 4 KiB pages: 8 tokens each
        generate(model, ids, mask, cache, max_new_tokens=9)  # 20 tokens cached
        kv = cache.kv_cache
        pages = [kv.mapped_pages(slot) for slot in cache.slots]
        cache.crop(-5)
        assert cache.get_seq_length() == 15 and all(layer.length == 15 for layer in cache.layers)
        assert [kv.seq_lens()[slot] for slot in cache.slots] == [15, 15, 15]
        assert [kv.mapped_pages(slot) for slot in cache.slots] == pages
        cache.crop(12)  # transformers' older meaning: the length to keep
        assert cache.get_seq_length() == 12
        with pytest.raises(ValueError, match="tokens_to_remove = -13 removes more than the 12 cached tokens"):
            cache.crop(-13)


def test_the_cache_goes_in_under_the_name_this_transformers_takes(recwarn):
    """transformers 5.24 renamed past_key_values to cache (forward() drops the old name in
    5.40): as_kwargs() passes the name the installed version takes, and nothing warns."""
    model = tiny_llama()
    ids, mask = prompts(model)
    with vkv_cache(model) as cache:
        assert cache.as_kwargs() == {CACHE: cache} and cache.as_kwargs(model) == {CACHE: cache}
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, **cache.as_kwargs())
            cache.reset()
            model(input_ids=ids, attention_mask=mask, use_cache=True, **cache.as_kwargs(model))
    deprecations = [str(w.message) for w in recwarn if "past_key_values" in str(w.message)]
    assert deprecations == []
