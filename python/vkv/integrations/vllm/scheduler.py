"""VkvScheduler: the scheduler-side half of VkvConnector (connector.py), in vLLM's EngineCore.

Once a step (``build_connector_meta``): the blocks the worker backed go into vLLM's pool,
the demand of the next steps is counted (demand.py), the shared budget says what it wants
of this engine (engine_budget.py), the plan takes back what goes back (balloon.py), and the
metadata tells the worker which blocks to release and how many to keep backed.

vLLM steps an engine only while it has requests or ``has_pending_push_work()``; this side
asks for steps only while its own work is in flight: free blocks waiting for their second
step before they go back, the worker's backing that may still land (a few steps), blocks
given to the budget that the worker has not released yet, and a share the budget wants of
this engine. An idle engine therefore goes quiet within a few steps of its last request,
cached blocks and all, and vLLM's pause, sleep and reset complete as on its own pool; the
budget wakes it when it wants something of it (engine_budget.py, wakeup.py).
"""

from typing import Optional

from .balloon import Balloon
from .block_states import UNBACKED, BlockStates
from .config import VkvConnectorConfig, budget_label
from .demand import Demand
from .engine_budget import EngineBudget
from .metadata import VkvConnectorMetadata
from .wakeup import find_engine_wakeup
from .workers import engine_budget_names


# The most bytes of blocks a step's job backs ahead of need: with the job's fixed cost, about
# a millisecond of driver calls on a GPU, which a decode step's forward hides.
AHEAD_BYTES_PER_JOB = 32 << 20


class VkvScheduler:
    """Not thread-safe: vLLM calls the scheduler-side connector from its one engine thread
    (the budget's watcher threads only set ``EngineBudget.owed``)."""

    def __init__(self, vllm_config, kv_cache_config, settings: VkvConnectorConfig, engine_id: str) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.settings = settings
        self.engine_id = engine_id
        self.balloon: Optional[Balloon] = None
        self.demand: Optional[Demand] = None
        self.budget: Optional[EngineBudget] = None
        self._most_blocks: Optional[int] = None
        # Made while vLLM's EngineCoreProc builds the scheduler: its loop, to wake when idle.
        self._wakeup = find_engine_wakeup()
        self._released_this_step = False
        self._pending = False
        self._expecting_steps = 0  # consecutive steps the worker was told to back more than landed
        self._given: list = []  # blocks given to the budget whose release is not seen yet

    def bind(self, pool) -> None:
        """``bind_gpu_block_pool``: take the pool's free blocks out, count the demand."""
        states = BlockStates(self.engine_id, pool.num_gpu_blocks)
        tensors = getattr(self.kv_cache_config, "kv_cache_tensors", None) or []
        # One block's bytes over every KV tensor (1 where vLLM has not sized them yet).
        all_layers_block_bytes = max(1, sum(t.size for t in tensors) // pool.num_gpu_blocks)
        self.balloon = Balloon(pool, states, self.settings.headroom_blocks,
                               ahead_per_job=max(1, AHEAD_BYTES_PER_JOB // all_layers_block_bytes))
        config = self.vllm_config
        sched = config.scheduler_config
        # A step writes 1 token per running request, + the speculative/lookahead ones.
        tokens_per_step = 1 + config.num_speculative_tokens + config.num_lookahead_tokens
        # The worker's job on its thread lands one step later: plan one step further unless
        # it is off (this side does not know the worker's device: unset counts as on).
        self._lag = 1 if self.settings.background_mapping is False else 2
        self.demand = Demand(config.cache_config.block_size, tokens_per_step, sched.max_num_seqs,
                             sched.max_num_batched_tokens, steps_ahead=self._lag + 1,
                             full_prompt_must_fit=bool(getattr(sched, "scheduler_reserve_full_isl", False)),
                             # vLLM's KVCacheManager: int(watermark * kv_cache_config.num_blocks)
                             watermark_blocks=int(getattr(sched, "watermark", 0.0) * pool.num_gpu_blocks),
                             max_model_len=config.model_config.max_model_len,
                             groups=len(getattr(self.kv_cache_config, "kv_cache_groups", None) or [None]))
        if self.settings.shared_budget:
            block_bytes = tensors[0].size // pool.num_gpu_blocks if tensors else 1
            # The most blocks its own memory_budget lets it back: it asks the others for no more.
            self._most_blocks = self.settings.memory_budget // block_bytes - 1 if self.settings.memory_budget else None
            self.budget = EngineBudget(engine_budget_names(config, self.settings), budget_label(self.engine_id),
                                       block_bytes, self._wakeup)

    def on_new_request(self, request) -> None:
        if self.demand is not None:
            self.demand.added(request)

    def request_finished(self, request) -> None:
        if self.demand is not None:
            self.demand.finished(request.request_id)

    def release_backed_once(self) -> None:
        """What the worker backed since the last step into the pool, once a step, before
        schedule() hands out blocks (``get_num_new_matched_tokens``, ``update_connector_output``)."""
        if self.balloon is not None and not self._released_this_step:
            self.balloon.release_backed()
            self._released_this_step = True

    def build_meta(self, scheduler_output) -> VkvConnectorMetadata:
        if self.balloon is None or self.demand is None:
            raise RuntimeError("VkvConnector: build_connector_meta() before bind_gpu_block_pool()")
        balloon, budget = self.balloon, self.budget
        need = self.demand.blocks(scheduler_output)
        self.release_backed_once()
        self._released_this_step = False
        # The shared budget: what it wants back of this engine, and how much its worker may back.
        give, room = budget.share() if budget is not None else (0, None)
        ahead = self.demand.growth(scheduler_output, self.settings.map_ahead_steps)
        release, target, given = balloon.plan(need, give, room, ahead)
        self._expecting_steps = self._expecting_steps + 1 if balloon.expecting() else 0
        settled = self._track_given(release[:given]) if given or self._given else False
        if budget is not None:
            # What the need lacks (the budget counts its free capacity against it): a standing ask.
            ask = balloon.shortfall
            if self._most_blocks is not None:
                ask = min(ask, max(0, self._most_blocks - balloon.in_pool()))
            budget.report(spare_blocks=balloon.spare(balloon.headroom + need), ask_blocks=ask, given_blocks=given,
                          settled=settled)
        # Blocks given back, until their release is seen.
        self._pending = (balloon.giving_back() or 0 < self._expecting_steps <= self._lag + 1 or bool(self._given)
                         or (budget is not None and budget.owed))
        return VkvConnectorMetadata(release=release, target_backed=target, job=balloon.job,
                                    forward=scheduler_output.total_num_scheduled_tokens > 0)

    def _track_given(self, given) -> bool:
        """Blocks given to the budget stay promised until the worker released them; at the
        step that sees the last of them released, what the promises still keep is forgotten
        (a page several blocks share gives back fewer bytes than the blocks were counted for)."""
        pending = bool(self._given)
        if pending and self.balloon is not None:
            states = self.balloon.states.view
            self._given = [block for block in self._given if states[block] != UNBACKED]
        settled = pending and not self._given
        self._given.extend(given)
        return settled

    def has_pending_push_work(self) -> bool:
        """vLLM steps its engine only while this or a request says so (``Scheduler.has_requests``)."""
        return self._pending or (self.budget is not None and self.budget.owed)

    def stats(self) -> dict:
        """Blocks in use, free in the pool, held out of it."""
        b = self.balloon
        if b is None:
            return {}
        return {"in_use": b.in_use(), "free_in_pool": b.pool.get_num_free_blocks(), "held": b.held}

    def shutdown(self) -> None:
        if self.budget is not None:
            self.budget.close()
            self.budget = None
        if self.balloon is not None:
            self.balloon.states.unlink()

