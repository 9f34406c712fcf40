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
        self.served = 0  # steps until the last wave's requests all finished (the quiet steps after: not counted)
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
        run.served = run.steps
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
    assert vkv_run.served <= own.served + 6, (vkv_run.served, own.served)
    late = {r: (vkv_run.first_step[r], own.first_step[r]) for r in own.first_step
            if vkv_run.first_step.get(r, 10**9) > own.first_step[r] + 3}
    assert not late, late


def _budget(blocks):
    import vkv
    return vkv.SharedBudget.create(f"vkv-vllm-test-{uuid.uuid4().hex[:10]}", blocks * vt.block_bytes(), device="cpu")


@pytest.mark.parametrize("background", [False, True])
def test_an_idle_engine_gives_another_what_it_lacks_and_keeps_the_rest(background):
    # Engine A serves requests sharing a prefix, then has none: within a few steps vLLM's loop
    # stops stepping it (has_work() false), its cached free blocks kept (prefix hits). Engine B
    # then wants more than the budget has free: it asks for what it lacks; A's budget thread
    # makes A owe a share, vLLM's loop steps A (here: this test, when A says it has work), and A
    # gives that share, not its whole cache, and goes quiet again. B runs everything.
    capacity = 200
    budget = _budget(capacity)
    extra = {"headroom_blocks": HEADROOM, "shared_budget": budget.name, "background_mapping": background}
    a = vt.Engine(256, extra, max_num_seqs=8, max_num_batched_tokens=512)
    b = vt.Engine(256, extra, max_num_seqs=8, max_num_batched_tokens=512)
    block = vt.block_bytes()

    def held(engine):
        return vt.backing(engine).stats()["bytes_held"] // block

    def asking(engine):
        label = engine.vllm_config.kv_transfer_config.engine_id
        return sum(m["bytes_wanted"] for m in budget.stats()["members"] if m["label"] == label) // block

    try:
        prefix = _prompt(7, 512)
        for i in range(8):
            a.add(f"a{i}", prefix + _prompt(50 + i, 64 + 16 * i), 16)
        while a.unfinished():
            a.step(read_back=False)
        quiet = 0
        while a.busy():
            a.step(read_back=False)
            quiet += 1
            assert quiet <= 4, "vLLM's loop kept stepping an idle engine"
        held_a, in_use_a = held(a), a.connector.stats()["in_use"]
        assert held_a > in_use_a + HEADROOM + 40, (held_a, in_use_a)  # nobody asked: its cache is kept
        free = budget.stats()["free_bytes"] // block
        for i in range(8):
            b.add(f"b{i}", _prompt(300 + i, 160 + 40 * i), 24)
        steps, stall, most_ask, a_steps, most_b = 0, 0, 0, 0, 0
        while b.unfinished():
            b.step(read_back=False)
            steps += 1
            assert steps < 600, "B never finished"
            stall = stall + 1 if not b.scheduler.running and b.scheduler.waiting else 0
            assert stall < 200, "B waited with nothing running"
            most_ask = max(most_ask, asking(b))
            most_b = max(most_b, held(b))
            while a.busy():  # A owes the budget a share: vLLM's loop steps it
                a.step(read_back=False)
                a_steps += 1
        assert most_ask > 0 and a_steps > 0, (most_ask, a_steps)
        given = held_a - held(a)
        # No more than B asked for (a block's rounding at each ask aside). B asks for its next
        # steps' demand, all its waiting prompts included, so it may ask for more than it ends
        # up holding at once; how much depends on how B's steps and A's thread interleave.
        assert 0 < given <= max(most_b - free, most_ask) + 8, (held_a, held(a), most_b, free, most_ask)
        assert held(a) > in_use_a + HEADROOM, held(a)
    finally:
        a.close()
        b.close()
        budget.remove()
