"""The engine tells its store the rhythm of its iterations (lab/serving/engine.py): after
every iteration, and whenever it has nothing running and no step in flight (before it waits
for an arrival, after a run): what kvcached's store releases its freed pages on."""

import numpy as np
import torch

from lab.serving.engine import Engine
from lab.serving.model import SHAPES, LlamaModel
from lab.serving.workload import make_trace
from lab.stores.kv_stores import StaticStore


class RecordingStore(StaticStore):
    """A static store that records the engine's calls, with how many slots were allocated."""

    def __init__(self, *arguments):
        super().__init__(*arguments)
        self.calls = []

    def after_iteration(self):
        self.calls.append(("iteration", self.slots - len(self._free)))

    def on_idle(self):
        self.calls.append(("idle", self.slots - len(self._free)))


def test_the_engine_tells_its_store_each_iteration_and_when_it_goes_idle():
    torch.set_num_threads(1)
    shape = SHAPES["tiny"]
    model = LlamaModel(shape, torch.device("cpu"), torch.float32, 256)
    store = RecordingStore(shape.num_layers, shape.num_kv_heads, shape.head_dim, torch.float32, torch.device("cpu"),
                           256, 1 << 20)
    trace = make_trace(4, float("inf"), 256, shape.vocab, seed=1, scale=0.05)
    for request in trace:
        request.output_len = 4
    for request in trace[2:]:
        request.arrival = 1.0  # after the first two have finished: the engine idles in between
    result = Engine(model, store, 512).run(trace, show_progress=False)
    kinds = [kind for kind, _ in store.calls]
    assert kinds.count("iteration") == result.iterations
    assert store.calls[-1] == ("idle", 0)  # after the run, every slot freed
    gap = kinds.index("idle")
    assert 0 < gap < len(kinds) - 1 and store.calls[gap][1] == 0  # before the wait, nothing allocated
    assert all(np.isfinite(r.finished_at) for r in trace[:2])
    assert min(r.first_token_at for r in trace[2:]) >= 1.0
