"""vkv's MLA pool beside SGLang's own, on the CPU. SGLang's CPU engine cannot run an MLA model
(DeepSeek-V2's), so instead of an engine, this test makes the calls SGLang's scheduler and its
MLA attention backends make, the same ones on both sides: vkv's ``VkvMLATokenToKVPool`` with
its paged allocator (drawing from a shared budget smaller than the pool, beside another
member that takes and asks for memory, with its budget speaker giving back) and SGLang's
``MLATokenToKVPool`` with its ``PagedTokenToKVPoolAllocator``, built with the same arguments.
After every call: every live token's latents read back through SGLang's getters bitwise
equal on both sides; vkv hands out only backed pages and loses none; every byte of vkv's
mapped memory holds what was last written there, or zeros where it was mapped anew; the
buffers keep SGLang's shapes, strides and dtypes. Needs SGLang: scripts/install_sglang.sh,
then run with its Python."""

import importlib.util
import random
import sys
import uuid
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install_sglang.sh)", allow_module_level=True)

import sglang_testing as st  # noqa: E402

sys.path.append(str(st.STUBS))  # SGLang's pool modules import sgl_kernel: its stand-in where none is installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

import vkv  # noqa: E402
from vkv.integrations.sglang.allocator import VkvPagedTokenToKVPoolAllocator  # noqa: E402
from vkv.integrations.sglang.layout import mla_layout, views  # noqa: E402
from vkv.integrations.sglang.pool import VkvMLATokenToKVPool  # noqa: E402
from vkv.integrations.sglang import sharing  # noqa: E402
from vkv.integrations.sglang.sharing import BudgetSpeaker  # noqa: E402

PAGE = 16  # tokens an allocator page
POOL_PAGES = 48
LAYERS = 3
VKV_PAGE = 4096  # the host backend's page
CALLS = 160  # scheduler iterations
FINISH = 0.1  # a live request's chance to finish at an iteration
BUDGET_SHARE = 0.55  # of the pool's memory, for vkv's pool and the other member together
OTHER_BLOCKS = 1024  # the other member's blocks, a vkv page each: more than the budget
# (kv_lora_rank, qk_rope_head_dim, dtype): DeepSeek-V2's latent (an allocator page is 4.5 or 9
# vkv pages of a layer's buffer), and a small one (4 allocator pages share 3 vkv pages).
MODELS = [pytest.param((512, 64, torch.bfloat16), id="576-bfloat16"),
          pytest.param((512, 64, torch.float32), id="576-float32"),
          pytest.param((32, 16, torch.float32), id="48-float32")]


@pytest.fixture(autouse=True)
def scheduler_context(monkeypatch):
    """What SGLang's scheduler process has set: whether decode context parallelism is on
    (SGLang's MLA writes ask), and one intra-op thread (as the engine tests run SGLang: on a
    busy machine torch's thread pool makes each small gather milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # An idle engine's speaker reports at most every IDLE_REPORT_S (its passes without a report
    # give back unasked): here at none, so that the run does not depend on the machine's speed.
    monkeypatch.setattr(sharing, "IDLE_REPORT_S", float("inf"))
    try:
        with get_parallel().override(dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0):
            yield
    finally:
        torch.set_num_threads(threads)


class Pools:
    """vkv's MLA pool and paged allocator, and SGLang's, built with the same arguments."""

    def __init__(self, kv_lora_rank, qk_rope_head_dim, dtype):
        args = dict(size=POOL_PAGES * PAGE, page_size=PAGE, dtype=dtype, kv_lora_rank=kv_lora_rank,
                    qk_rope_head_dim=qk_rope_head_dim, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        self.dtype, self.kv_lora_rank = dtype, kv_lora_rank
        self.dim = kv_lora_rank + qk_rope_head_dim
        self.sglang = MLATokenToKVPool(**args)
        self.sglang_allocator = PagedTokenToKVPoolAllocator(POOL_PAGES * PAGE, PAGE, dtype, "cpu", self.sglang,
                                                            need_sort=True)
        self.vkv = VkvMLATokenToKVPool(**args)
        self.vkv_allocator = VkvPagedTokenToKVPoolAllocator(POOL_PAGES * PAGE, PAGE, dtype, "cpu", self.vkv,
                                                            need_sort=True)
        self.backing = self.vkv.vkv_backing
        self.layout = self.vkv.vkv_layout

    def close(self):
        self.backing.close()


@pytest.fixture
def pools(monkeypatch):
    """``pools(model, short_budget)``: Pools over a new host budget, named by VKV_SGLANG_BUDGET
    as a user starts SGLang: BUDGET_SHARE of the pool's memory (``short_budget``), or more than
    all of it."""
    made, budgets = [], []

    def build(model, short_budget=False):
        kv_lora_rank, qk_rope_head_dim, dtype = model
        pool_bytes = mla_layout(size=POOL_PAGES * PAGE, page_size=PAGE, layers=LAYERS,
                                kv_cache_dim=kv_lora_rank + qk_rope_head_dim, itemsize=dtype.itemsize,
                                vkv_page_bytes=VKV_PAGE).reserved_bytes
        budget_bytes = int(pool_bytes * BUDGET_SHARE) // VKV_PAGE * VKV_PAGE if short_budget else 2 * pool_bytes
        budget = vkv.SharedBudget.create(f"sglang-mla-{uuid.uuid4().hex[:8]}", budget_bytes, device="cpu")
        budgets.append(budget)
        monkeypatch.setenv("VKV_SGLANG_BUDGET", budget.name)
        made.append(Pools(*model))
        return made[-1], budget

    yield build
    for each in made:
        each.close()
    for budget in budgets:
        budget.remove()


def _layer(layer_id):
    return SimpleNamespace(layer_id=layer_id)  # all SGLang's pools read of a RadixAttention


def _bits(tensor):
    return tensor.contiguous().view(torch.uint8)


def _write(pools, layer_id, vkv_loc, sglang_loc, latents, split):
    """The latents of new tokens, through the pools' own setters: the whole vector (as SGLang's
    Triton, FlashMLA and CPU backends write it) or its nope and rope parts (FlashInfer's and
    TRT-LLM's MLA backends)."""
    for pool, loc in ((pools.vkv, vkv_loc), (pools.sglang, sglang_loc)):
        if split:
            pool.set_mla_kv_buffer(_layer(layer_id), loc, latents[..., :pools.kv_lora_rank],
                                   latents[..., pools.kv_lora_rank:])
        else:
            pool.set_kv_buffer(_layer(layer_id), loc, latents, None)


def _mapped_pages(pools):
    """Which vkv pages of the reservation hold memory: those with bytes of a backed page
    (the backing maps a page while a backed block has bytes on it)."""
    mapped = np.zeros(pools.layout.reserved_bytes // VKV_PAGE, dtype=bool)
    for block in np.flatnonzero(np.asarray(pools.backing.states)):
        for start, length, stride in pools.layout.ranges():
            first = start + int(block) * stride
            mapped[first // VKV_PAGE:(first + length - 1) // VKV_PAGE + 1] = True
    return mapped


def _same_buffers(vkv_tensors, sglang_tensors):
    assert [(t.shape, t.stride(), t.dtype, t.device) for t in vkv_tensors] == \
        [(t.shape, t.stride(), t.dtype, t.device) for t in sglang_tensors]


def _check(pools, live, shadow, held=None):
    """What must hold after every call. ``live``: the requests' token slots with latents
    written, [(vkv's, SGLang's)]; ``shadow``: what vkv's reservation must hold (bytes);
    ``held``: each request's vkv slots, those just allocated included (default: live's)."""
    vkv_pool, sglang_pool, allocator = pools.vkv, pools.sglang, pools.vkv_allocator
    states = np.asarray(pools.backing.states)
    # vkv's free list and its requests hold backed pages only, each once, and every backed page
    # is one of theirs (page 0 aside): nothing handed out unbacked, nothing lost.
    free = allocator.get_all_free_pages().tolist()
    held = [v for v, _ in live] if held is None else held
    used = [page for vkv_loc in held for page in sorted(set((vkv_loc // PAGE).tolist()))]
    assert len(set(free)) == len(free) and not set(free) & set(used) and len(set(used)) == len(used)
    assert sorted(free + used + [0]) == np.flatnonzero(states).tolist()
    # SGLang's leak check, with the pages vkv holds out counted as free.
    assert allocator.available_size() + allocator.unbacked_tokens() == pools.sglang_allocator.available_size()
    # The backing holds the vkv pages its backed blocks' ranges touch, and the pool's tensors
    # put every token slot of a request there (SGLang's kernels write and read them).
    mapped = _mapped_pages(pools)
    stats = pools.backing.stats()
    assert (stats["pages_held"], stats["pages_pending"]) == (int(mapped.sum()), 0)
    slots = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
    for buffer in vkv_pool.kv_buffer:
        row_bytes = buffer.stride(0) * buffer.element_size()
        first = buffer.data_ptr() - pools.backing.base + slots * row_bytes
        last = first + row_bytes - 1  # a slot's row is at most a vkv page: its first and last page hold it
        assert mapped[(first // VKV_PAGE).numpy()].all() and mapped[(last // VKV_PAGE).numpy()].all()
    # Every mapped byte holds what was last written there, zeros where mapped anew.
    pages = torch.from_numpy(np.flatnonzero(mapped))
    flat = pools.backing.tensor()
    ours, written = flat.view(-1, VKV_PAGE)[pages], shadow.view(-1, VKV_PAGE)[pages]
    assert torch.equal(ours, written), f"vkv pages {pages[(ours != written).any(1)].tolist()} differ"
    # Each live token's latents read back the same through each of SGLang's getters.
    if live:
        vkv_loc = torch.cat([v for v, _ in live])
        sglang_loc = torch.cat([s for _, s in live])
        for layer_id in range(LAYERS):
            for getter in ("get_key_buffer", "get_value_buffer"):
                ours, theirs = getattr(vkv_pool, getter)(layer_id), getattr(sglang_pool, getter)(layer_id)
                _same_buffers([ours], [theirs])
                assert torch.equal(_bits(ours[vkv_loc]), _bits(theirs[sglang_loc])), (getter, layer_id)
            pairs = zip(vkv_pool.get_kv_buffer(layer_id), sglang_pool.get_kv_buffer(layer_id))
            assert all(torch.equal(_bits(ours[vkv_loc]), _bits(theirs[sglang_loc])) for ours, theirs in pairs)
    _same_buffers(vkv_pool.kv_buffer, sglang_pool.kv_buffer)
    assert vkv_pool.data_ptrs.tolist() == [buffer.data_ptr() for buffer in vkv_pool.kv_buffer]


def _extend(allocator, batch):
    """SGLang's prefill of a batch: ``batch`` [(the request's slots so far, new tokens)];
    returns each request's new slots, or None."""
    prefix = torch.tensor([len(loc) for loc, _ in batch], dtype=torch.int64)
    seq = prefix + torch.tensor([count for _, count in batch], dtype=torch.int64)
    last = torch.tensor([int(loc[-1]) if len(loc) else -1 for loc, _ in batch], dtype=torch.int64)
    total = int((seq - prefix).sum())
    out = allocator.alloc_extend(prefix, prefix.clone(), seq, seq.clone(), last, total)
    return None if out is None else list(torch.split(out, [count for _, count in batch]))


def _decode(allocator, batch):
    """SGLang's decode of a batch: ``batch`` [the request's slots so far]; one new slot each."""
    seq = torch.tensor([len(loc) + 1 for loc in batch], dtype=torch.int64)
    last = torch.tensor([int(loc[-1]) for loc in batch], dtype=torch.int64)
    out = allocator.alloc_decode(seq, seq.clone(), last)
    return None if out is None else list(out.split(1))


def _on_new_pages(old_locs, new_locs):
    """The new slots on pages the request did not hold: what undoing the allocation frees."""
    held = set((old_locs // PAGE).tolist())
    return torch.cat([new[~torch.isin(new // PAGE, torch.tensor(sorted(held), dtype=torch.int64))]
                      for new in new_locs]) if new_locs else torch.empty(0, dtype=torch.int64)


class Run:
    """Both sides driven together, and what vkv's reservation must hold (``shadow``)."""

    def __init__(self, pair, budget):
        self.pair, self.budget = pair, budget
        self.allocator, self.sglang_allocator = pair.vkv_allocator, pair.sglang_allocator
        self.speaker = BudgetSpeaker(self.allocator, SimpleNamespace(tree_cache=None, tp_worker=None))
        # Another member of the budget: it takes memory, gives it back and asks for more.
        self.other = vkv.BlockBacking(OTHER_BLOCKS, VKV_PAGE, device="cpu", page_size=VKV_PAGE,
                                      shared_budget=budget.name, shared_budget_label="other",
                                      shared_budget_priority=1)
        self.shadow = torch.zeros(pair.layout.reserved_bytes, dtype=torch.uint8)
        self.shadow_buffers = views(self.shadow, pair.layout, pair.dtype)
        self.requests = []  # [vkv's slots, SGLang's slots] of each live request
        self.mapped = _mapped_pages(pair)
        self.seen = dict.fromkeys(("anew", "unmapped", "short", "tokens", "given"), 0)

    def check(self, new=()):
        """After a call: vkv's unmapped pages come back as zeros; then _check, with ``new``
        [(vkv's slots, SGLang's, the request)] allocated but not written yet."""
        mapped = _mapped_pages(self.pair)
        gone = torch.from_numpy(np.flatnonzero(self.mapped & ~mapped))
        self.shadow.view(-1, VKV_PAGE)[gone] = 0
        self.seen["anew"] += int((mapped & ~self.mapped).sum())
        self.seen["unmapped"] += len(gone)
        self.mapped = mapped
        pending = {id(request): vkv_new for vkv_new, _, request in new}
        _check(self.pair, [(r[0], r[1]) for r in self.requests if len(r[0])], self.shadow,
               held=[torch.cat([r[0], pending.get(id(r), r[0][:0])]) for r in self.requests])

    def allocate(self, batch, ours, theirs):
        """Both sides' answers to one allocation for ``batch``: vkv allocates where SGLang's
        pool would (never more), and fails only for what its budget could not give; a batch
        that either side could not allocate is undone (the scheduler would not run it)."""
        assert theirs is not None or ours is None
        if ours is None:
            self.seen["short"] += theirs is not None
            assert theirs is None or self.allocator.short_pages > 0
            if theirs is not None:
                self.sglang_allocator.free(_on_new_pages(torch.cat([r[1] for r in batch]), theirs))
            return []
        return list(zip(ours, theirs, batch))

    def write(self, new, rng, generator):
        for vkv_new, sglang_new, request in new:
            for layer_id in range(LAYERS):
                latents = torch.randn(len(vkv_new), 1, self.pair.dim, generator=generator).to(self.pair.dtype)
                _write(self.pair, layer_id, vkv_new, sglang_new, latents, split=rng.random() < 0.5)
                self.shadow_buffers[layer_id][vkv_new] = latents
            request[0], request[1] = torch.cat([request[0], vkv_new]), torch.cat([request[1], sglang_new])
        self.seen["tokens"] = max(self.seen["tokens"], sum(len(r[0]) for r in self.requests))

    def other_member(self, rng):
        """The other member gives back some of its memory, or takes more and asks for what
        the budget could not give."""
        held = np.flatnonzero(np.asarray(self.other.states))[1:]
        if rng.random() < 0.4 and len(held):
            self.other.release(held[:rng.randint(1, len(held))])
            return
        wanted = rng.randint(1, self.pair.layout.reserved_bytes // VKV_PAGE // 25)  # up to 4% of the pool's
        short = wanted - self.other.back(len(held) + wanted)
        if short:
            self.budget.speak_for("other", ask=short * VKV_PAGE)

    def close(self):
        self.other.close()


@pytest.mark.parametrize("model", MODELS)
def test_vkv_mla_pool_reads_back_what_sglangs_does_under_a_short_budget(pools, model):
    run = Run(*pools(model, short_budget=True))
    allocator, sglang_allocator, requests = run.allocator, run.sglang_allocator, run.requests
    rng = random.Random(11)
    generator = torch.Generator().manual_seed(11)
    try:
        run.check()
        for _ in range(CALLS):  # one scheduler iteration each
            roll = rng.random()
            if roll < 0.3:  # prefill: a new request (or two), and the next chunk of a live one
                fresh = [[torch.empty(0, dtype=torch.int64)] * 2 for _ in range(1 + (rng.random() < 0.3))]
                batch = [r for r in requests if rng.random() < 0.2][:1] + fresh
                counts = [rng.randint(1, 90) for _ in batch]
                if rng.random() < 0.5:  # the scheduler's capacity hooks first: growth ahead of the allocation
                    allocator.ensure_free(sum(-(-c // PAGE) + 1 for c in counts) * PAGE)
                new = run.allocate(batch, _extend(allocator, list(zip([r[0] for r in batch], counts))),
                                   _extend(sglang_allocator, list(zip([r[1] for r in batch], counts))))
                requests.extend(fresh if new else ())
            elif roll < 0.7 and requests:  # decode
                batch = rng.sample(requests, rng.randint(1, len(requests)))
                new = run.allocate(batch, _decode(allocator, [r[0] for r in batch]),
                                   _decode(sglang_allocator, [r[1] for r in batch]))
            else:
                new = []
                if roll < 0.8:
                    allocator.give_back(rng.randint(1, 6), keep_pages=rng.randint(0, 2))
                else:
                    run.other_member(rng)
            run.check(new)  # before the new tokens' latents are written: pages mapped anew read zeros
            run.write(new, rng, generator)
            finished = [rng.random() < FINISH for _ in requests]  # after the forward: requests that finish
            for request in [r for r, done in zip(requests, finished) if done]:
                allocator.free(request[0])
                sglang_allocator.free(request[1])
            requests[:] = [r for r, done in zip(requests, finished) if not done]
            run.check()
            # The iteration's end: the budget speaker reports and gives back what is asked
            # (idle: every free page beyond the headroom).
            run.seen["given"] += run.speaker.step(idle=not requests)
            run.check()
    finally:
        run.close()
    # The sequence made vkv map memory anew, unmap it, run short of its budget, give back, and
    # hold many tokens at once.
    seen = run.seen
    assert seen["anew"] > 20 and seen["unmapped"] > 20 and seen["short"] >= 3, seen
    assert seen["given"] > 5 and seen["tokens"] > POOL_PAGES * PAGE // 3, seen


@pytest.mark.parametrize("model", MODELS[:1])
@pytest.mark.parametrize("small", [False, True], ids=["two-pages", "one-byte"])
def test_an_ask_through_the_budget_takes_free_pages_only(pools, model, small):
    run = Run(*pools(model, short_budget=True))
    rng, generator = random.Random(5), torch.Generator().manual_seed(5)
    try:
        batch = [[torch.empty(0, dtype=torch.int64)] * 2 for _ in range(3)]
        new = run.allocate(batch, _extend(run.allocator, [(r[0], 4 * PAGE) for r in batch]),
                           _extend(run.sglang_allocator, [(r[1], 4 * PAGE) for r in batch]))
        run.requests.extend(batch)
        run.check(new)
        run.write(new, rng, generator)
        finished = run.requests.pop(1)
        run.allocator.free(finished[0])
        run.sglang_allocator.free(finished[1])
        run.check()
        free_pages = len(run.allocator.get_all_free_pages())
        assert free_pages >= 4 and run.allocator.short_pages == 0
        # The other member takes all the budget has left, and asks for two allocator pages'
        # memory, or for one byte: less than any page frees (a vkv page in every layer), which
        # must still be answered.
        taken = run.other.back(OTHER_BLOCKS - 1)
        assert 0 < taken < OTHER_BLOCKS - 1
        ask = 1 if small else 2 * run.allocator.token_page_bytes
        assert run.budget.speak_for("other", ask=ask)["open_bytes"] == ask
        run.check()
        # vkv's engine gives back free pages at its step, and the other member has their memory.
        given = run.speaker.step(idle=False)
        assert 0 < given <= free_pages, given
        run.check()
        assert len(run.allocator.get_all_free_pages()) == free_pages - given
        assert run.other.back(OTHER_BLOCKS - 1) > 0
        run.check()
    finally:
        run.close()


@pytest.mark.parametrize("model", MODELS[:1])
def test_a_standing_ask_is_withdrawn_once_what_it_wanted_is_free(pools, model):
    # A prefill the budget could not back leaves an ask; a request that finishes frees what it
    # wanted, and the next step withdraws the ask instead of holding the others to it.
    run = Run(*pools(model, short_budget=True))
    rng, generator = random.Random(7), torch.Generator().manual_seed(7)
    try:
        first = [torch.empty(0, dtype=torch.int64)] * 2
        new = run.allocate([first], _extend(run.allocator, [(first[0], 12 * PAGE)]),
                           _extend(run.sglang_allocator, [(first[1], 12 * PAGE)]))
        assert new
        run.requests.append(first)
        run.check(new)
        run.write(new, rng, generator)
        # Two pages more than the budget has free.
        beyond = run.budget.stats()["free_bytes"] // run.allocator.token_page_bytes + 2
        assert not run.allocator.ensure_free(run.allocator.available_size() + beyond * PAGE)
        short = run.allocator.short_pages
        assert 0 < short <= 12, short
        run.speaker.step(idle=False)
        assert run.budget.share_of(run.speaker.label)["asking_bytes"] > 0
        finished = run.requests.pop()
        run.allocator.free(finished[0])
        run.sglang_allocator.free(finished[1])
        run.speaker.step(idle=False)
        assert run.allocator.short_pages == 0
        assert run.budget.share_of(run.speaker.label)["asking_bytes"] == 0
        run.check()
    finally:
        run.close()


@pytest.mark.parametrize("model", MODELS[:1])
def test_sglangs_pool_calls_answer_on_vkv_mla_pool_as_on_sglangs(pools, model):
    pair, _ = pools(model)
    ours, theirs = pair.vkv, pair.sglang
    # What SGLang logs and sizes by, and what PD disaggregation registers and transfers by.
    assert ours.get_kv_size_bytes() == theirs.get_kv_size_bytes() and ours.mem_usage == theirs.mem_usage
    assert ours.get_kv_buffer_shape() == theirs.get_kv_buffer_shape()
    ptrs, lens, item_lens = ours.get_contiguous_buf_infos()
    assert ptrs == [buffer.data_ptr() for buffer in ours.kv_buffer]
    assert (lens, item_lens) == theirs.get_contiguous_buf_infos()[1:]
    assert (ours.data_ptrs.dtype, ours.data_ptrs.device) == (theirs.data_ptrs.dtype, theirs.data_ptrs.device)
    # What HiCache builds its host pool from.
    (info,), (their_info,) = ours.get_device_pool_infos(), theirs.get_device_pool_infos()
    info.buffer_info.validate(layer_ids=info.layer_ids)
    skip = {"buffers", "data_ptrs"}
    fields = [f for f in type(info.buffer_info).__struct_fields__ if f not in skip]
    assert [getattr(info.buffer_info, f) for f in fields] == [getattr(their_info.buffer_info, f) for f in fields]
    assert (info.pool_name, info.layer_ids) == (their_info.pool_name, their_info.layer_ids)
    _same_buffers(info.buffer_info.buffers, their_info.buffer_info.buffers)
    assert [b.data_ptr() for b in info.buffer_info.buffers] == ptrs
    assert torch.equal(info.buffer_info.data_ptrs, ours.data_ptrs)
    assert [d.device_pool for d in ours.host_pool_decls()] == [ours]
    # Retraction's offload and reload (get_cpu_copy, load_cpu_copy) and speculative
    # decoding's move of accepted tokens (move_kv_cache), on the same tokens of both pools.
    vkv_loc, sglang_loc = pair.vkv_allocator.alloc(4 * PAGE), pair.sglang_allocator.alloc(4 * PAGE)
    generator = torch.Generator().manual_seed(3)
    for layer_id in range(LAYERS):
        latents = torch.randn(4 * PAGE, 1, pair.dim, generator=generator).to(pair.dtype)
        _write(pair, layer_id, vkv_loc, sglang_loc, latents, split=False)
    copies = ours.get_cpu_copy(vkv_loc), theirs.get_cpu_copy(sglang_loc)
    assert [len(layer) for layer in copies[0]] == [len(layer) for layer in copies[1]]
    assert all(torch.equal(_bits(a), _bits(b)) for ours_layer, theirs_layer in zip(*copies)
               for a, b in zip(ours_layer, theirs_layer))
    pair.vkv_allocator.free(vkv_loc)
    pair.sglang_allocator.free(sglang_loc)
    vkv_loc, sglang_loc = pair.vkv_allocator.alloc(4 * PAGE), pair.sglang_allocator.alloc(4 * PAGE)
    ours.load_cpu_copy(copies[0], vkv_loc)
    theirs.load_cpu_copy(copies[1], sglang_loc)
    ours.move_kv_cache(vkv_loc[:PAGE], vkv_loc[2 * PAGE:3 * PAGE])
    theirs.move_kv_cache(sglang_loc[:PAGE], sglang_loc[2 * PAGE:3 * PAGE])
    for layer_id in range(LAYERS):
        assert torch.equal(_bits(ours.get_key_buffer(layer_id)[vkv_loc]),
                           _bits(theirs.get_key_buffer(layer_id)[sglang_loc]))
