"""vkv.integrations.vllm under vLLM 0.33's shipped defaults, against vLLM's own pool of the
same memory driven by the same requests: prefix caching on, async scheduling (AsyncScheduler,
stepped as vLLM's batch queue), full-prompt reservation, the KV cache config from vLLM's
planner, long prompts on small chunks, a pool of 30,000 blocks. The scheduler's real code
on a CPU (host backend); the fake forward is off (``read_back=False``): these tests are
about what is scheduled, test_vllm_connector.py about the bytes.

Skips only where vllm is not importable and CI is not set."""

import uuid

import pytest

from lab.vllm_engine import require_vllm  # noqa: E402  (the checkout, on pytest's pythonpath)

require_vllm()

from lab import vllm_engine as vt  # noqa: E402

HEADROOM = 4


class Run:
    """What one engine did with a trace: steps, admissions, prefix-hit tokens, stalls."""

    def __init__(self) -> None:
        self.steps = 0
        self.first_step = {}  # request -> step it was first scheduled
        self.hit_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.longest_stall = 0  # most steps in a row with requests waiting and nothing scheduled
        self._stalled = 0

    def saw(self, engine, out) -> None:
        self.steps += 1
        for new in out.scheduled_new_reqs:
            self.first_step.setdefault(new.req_id, self.steps)
            self.hit_tokens += new.num_computed_tokens
        if out.total_num_scheduled_tokens == 0 and engine.scheduler.waiting:
            self._stalled += 1
            self.longest_stall = max(self.longest_stall, self._stalled)
        else:
            self._stalled = 0


def _drive(engine, waves, limit, idle_between=True) -> Run:
    """Add each wave's requests, step until they finish (at most ``limit`` steps in all),
    then step as vLLM's loop would while the engine says it has work."""
    run = Run()
    for wave in waves:
        for request_id, prompt, gen in wave:
            engine.add(request_id, prompt, gen)
        while engine.unfinished() and run.steps < limit:
            run.saw(engine, engine.step(read_back=False))
        if idle_between:
            quiet = 0
            while engine.busy() and quiet < 8:  # vLLM steps an engine while it has work
                run.saw(engine, engine.step(read_back=False))
                quiet += 1
    return run


def _both(num_blocks, waves, limit, extra=None, **options):
    """The same waves on vkv memory and on vLLM's own pool of ``num_blocks``."""
    runs = []
    for connector in (True, False):
        engine = vt.Engine(num_blocks, dict({"headroom_blocks": HEADROOM}, **(extra or {})), connector=connector,
                           **options)
        try:
            runs.append(_drive(engine, waves, limit))
        finally:
            engine.close()
    return runs


def _prompt(seed, length):
    return [(seed * 7919 + 31 * t) % 997 + 1 for t in range(length)]


@pytest.mark.parametrize("case", [
    # (prompt tokens, requests, chunk = max_num_batched_tokens, pool blocks)
    (5000, 41, 2048, 30000),  # 41 requests wait behind a 5K prompt on 2K chunks
    (8000, 3, 512, 2000),  # an 8,000-token prompt on 512-token chunks
    (4000, 6, 256, 2000),  # 4K prompts on 256-token chunks
], ids=["5K-on-2K-chunks-30000-blocks", "8K-on-512", "4K-on-256"])
def test_long_prompts_are_admitted_as_on_vllms_own_pool(case):
    # vLLM admits a waiting request only when its whole prompt fits in free blocks
    # (scheduler_reserve_full_isl, its default) and stops at the first that does not: the
    # pool must keep the head-of-line prompt whole, not a few chunks of it.
    prompt, requests, chunk, blocks = case
    waves = [[(f"r{i}", _prompt(i, prompt), 4) for i in range(requests)]]
    options = dict(max_num_seqs=16, max_num_batched_tokens=chunk, max_model_len=prompt + 64)
    # Synchronous mapping (the CPU's default): the plan looks 2 steps of chunks ahead, fewer
    # tokens than one 5K prompt on 2K chunks.
    vkv_run, own = _both(blocks, waves, limit=4 * requests * (prompt // chunk + 8), extra={"background_mapping": False},
                         **options)
    assert len(own.first_step) == requests and own.longest_stall == 0
    assert len(vkv_run.first_step) == requests, f"{requests - len(vkv_run.first_step)} requests never admitted"
    assert vkv_run.longest_stall <= 3, vkv_run.longest_stall  # the backing's lag, not for ever
    assert vkv_run.steps <= own.steps * 1.1 + 8, (vkv_run.steps, own.steps)


def test_prefix_hits_are_kept_while_nobody_else_wants_the_memory():
    # Waves of requests sharing 6 long prefixes, the engine going quiet in between: a cached
    # free block is given back only when another engine wants memory, so the next wave finds
    # the prefixes as on vLLM's own pool.
    prefixes = [_prompt(100 + p, 384) for p in range(6)]
    waves = [[(f"w{w}r{i}", prefixes[(w + i) % 6] + _prompt(1000 * w + i, 40 + 8 * (i % 3)), 8) for i in range(8)]
             for w in range(6)]
    vkv_run, own = _both(1024, waves, limit=2000, max_num_seqs=8, max_num_batched_tokens=512)
    assert own.hit_tokens > 10_000, own.hit_tokens
    assert vkv_run.hit_tokens >= 0.9 * own.hit_tokens, (vkv_run.hit_tokens, own.hit_tokens)


def test_the_watermark_admits_requests_as_on_vllms_own_pool():
    # watermark=0.05: vLLM admits a request while others run only when its blocks + 5% of
    # the pool are free; the balloon keeps those free too, or requests wait until nothing runs.
    waves = [[(f"r{i}", _prompt(i, 90 + 13 * (i % 5)), 24 + i % 7) for i in range(40)]]
    vkv_run, own = _both(1000, waves, limit=800, max_num_seqs=8, max_num_batched_tokens=512, watermark=0.05)
    assert vkv_run.steps <= own.steps + 6, (vkv_run.steps, own.steps)
    late = {r: (vkv_run.first_step[r], own.first_step[r]) for r in own.first_step
            if vkv_run.first_step.get(r, 10**9) > own.first_step[r] + 3}
    assert not late, late


def _budget(blocks):
    import vkv
    return vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", blocks * vt.block_bytes(), device="cpu")


@pytest.mark.parametrize("background", [False, True])
def test_an_idle_engine_gives_its_cached_blocks_to_the_one_that_asks(background):
    # Engine A serves requests sharing a prefix, then has none: it keeps its cached free
    # blocks while nobody asks (prefix hits), and vLLM's loop keeps stepping it for that
    # (has_pending_push_work). Engine B then wants more than the budget has free: within 2 of
    # A's steps after B's ask, A holds at most its blocks in use + headroom, and B runs
    # everything without waiting for ever.
    capacity = 200
    budget = _budget(capacity)
    extra = {"headroom_blocks": HEADROOM, "shared_budget": budget.name, "background_mapping": background}
    a = vt.Engine(256, extra, max_num_seqs=8, max_num_batched_tokens=512)
    b = vt.Engine(256, extra, max_num_seqs=16, max_num_batched_tokens=512)
    try:
        prefix = _prompt(7, 512)
        for i in range(8):
            a.add(f"a{i}", prefix + _prompt(50 + i, 64 + 16 * i), 16)
        while a.unfinished():
            a.step(read_back=False)
        for _ in range(6):  # A goes quiet; its loop still steps it (it holds what B may ask for)
            assert a.busy(), "vLLM's loop stopped stepping an engine that holds free blocks of a shared budget"
            a.step(read_back=False)
        pages_a = a.worker._memory.cache.stats()["pages_created"]
        in_use_a = a.connector.stats()["in_use"]
        assert pages_a > in_use_a + HEADROOM + 40, (pages_a, in_use_a)  # nobody asked: its cache is kept
        for i in range(16):
            b.add(f"b{i}", _prompt(300 + i, 160), 24)
        asked_at, held_after, steps, stall, most_b = None, [], 0, 0, 0
        while b.unfinished():
            b.step(read_back=False)
            steps += 1
            assert steps < 400, "B never finished"
            most_b = max(most_b, b.worker._memory.cache.stats()["pages_created"])
            stall = stall + 1 if not b.scheduler.running and b.scheduler.waiting else 0
            assert stall < 50, "B waited with nothing running"
            asks = getattr(b.connector, "_asks", None)
            if asked_at is None and asks is not None and asks.rows[asks.row, 1] > 0:
                asked_at = steps
            if a.busy():
                a.step(read_back=False)
            if asked_at is not None:
                held_after.append(a.worker._memory.cache.stats()["pages_created"] - a.connector.stats()["in_use"])
        assert asked_at is not None, "B never asked"
        # + the null block and, on the CPU, the block vkv's mapper keeps mapped ahead
        assert min(held_after[1:3]) <= HEADROOM + 2, held_after[:6]
        assert most_b >= capacity - (HEADROOM + 2) - 8, most_b  # B got what A gave back
    finally:
        a.close()
        b.close()
        budget.remove()
