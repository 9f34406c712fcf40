"""vkv.vattention: the public vAttention module's calls, shapes and engine pattern over vkv.

The driver below is written from the documented engine pattern (sarathi-serve's vAttention
cache engine): alloc on arrival, seq_lens bookkeeping, step_async every iteration, free on
finish or preemption. It runs a seeded trace and checks that every token written reads back,
that fresh ids read zeros, and that num_free_kvblocks() adds up after every step.
"""

import dataclasses
import random

import pytest
import torch

import vkv
import vkv.vattention as vattention
from conftest import DEVICES, needs_cuda

HOST_PAGE = 64 << 10
CUDA_PAGE = 2 << 20


@pytest.fixture(autouse=True)
def clean_module():
    vattention.cleanup()
    yield
    vattention.set_verbose(False)
    vattention.cleanup()


def small_init(device="cpu", megacache=False, **options):
    """2 layers, 2 KV heads of 64, fp16, 4 ids of 1024 tokens; 64 KiB pages on the host:
    256 tokens per page per tensor (64 with megacache). No mapper: page counts are exact."""
    options.setdefault("background_mapping", False)
    return vattention.init_kvcache(2, 2, 64, 4, 1024, device, torch.float16, HOST_PAGE if device == "cpu" else 0,
                                   megacache, **options)


# -- the engine ------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
    seq_id: int
    arrival: int
    prompt_len: int
    output_len: int
    idx: int = -1
    length: int = 0  # tokens in the cache after this iteration
    generated: int = 0


def make_trace(seed, count, max_prompt, max_output):
    rng = random.Random(seed)
    return [Request(i, arrival=i // 2 + rng.randrange(3), prompt_len=rng.randrange(1, max_prompt),
                    output_len=rng.randrange(1, max_output)) for i in range(count)]


def pattern(request, layer, kv, start, end, heads, dim, device):
    """int16 codes for tokens [start, end) of one request's K or V of one layer: exact in any 2-byte dtype."""
    token = torch.arange(start, end, device=device, dtype=torch.int32).view(-1, 1, 1)
    head = torch.arange(heads, device=device, dtype=torch.int32).view(1, -1, 1)
    col = torch.arange(dim, device=device, dtype=torch.int32).view(1, 1, -1)
    base = request.seq_id * 7919 + layer * 131 + kv * 17
    return ((base + token * 31 + head * 3 + col) % 32749).to(torch.int16)


class Engine:
    """A continuous-batching loop that uses vattention exactly as the vAttention cache engine does."""

    def __init__(self, device, megacache, layout, *, num_layers=3, heads=2, dim=64, max_batch=6, max_context=1024,
                 page_size=HOST_PAGE, budget_pages=48, seed=0):
        self.device, self.megacache = device, megacache
        self.num_layers, self.heads, self.dim = num_layers, heads, dim
        self.max_batch, self.max_context, self.page_size = max_batch, max_context, page_size
        options = {} if layout is None else {"layout": layout}
        kv = vattention.init_kvcache(num_layers, heads, dim, max_batch, max_context, device, torch.bfloat16,
                                     page_size, megacache, **options)
        if megacache:
            assert len(kv) == 2
            assert kv[0].shape == (max_batch, max_context, num_layers, heads, dim)
            self.layers = [(kv[0][:, :, layer], kv[1][:, :, layer]) for layer in range(num_layers)]
        else:
            assert len(kv) == 2 * num_layers
            assert all(t.shape == (max_batch, max_context, heads, dim) for t in kv)
            self.layers = list(zip(kv[:num_layers], kv[num_layers:]))
        self.layout = vattention.kv_cache().layout
        self.budget_pages = vattention.reserve_physical_pages(budget_pages * page_size)
        assert self.budget_pages == budget_pages
        # What the reference calls a KV block, for admission (as the engine computes it).
        block_bytes = page_size if not megacache else page_size // num_layers
        self.block_tokens = block_bytes // (heads * dim * 2)
        self.pages_per_block = 2 if megacache else 2 * num_layers
        self.seq_lens = [0] * max_batch
        self.rng = random.Random(seed)
        self.peak_claim = {}  # idx -> most tokens it had since allocation: vkv keeps those pages
        self.counts = {"finished": 0, "preempted": 0, "out_of_memory": 0, "iterations": 0, "alloc_full": 0}

    # -- the engine's side of the accounting, computed without asking vkv ---------------

    def pages_for(self, tokens):
        token_bytes = self.heads * self.dim * 2 * (2 * self.num_layers if self.layout == "interleaved" else 1)
        regions = 1 if self.layout == "interleaved" else 2 * self.num_layers
        return regions * -(-tokens * token_bytes // self.page_size)

    def expected_free_blocks(self):
        in_use = sum(self.pages_for(tokens) for tokens in self.peak_claim.values())
        return (self.budget_pages - in_use) // self.pages_per_block

    # -- per-request work --------------------------------------------------------------

    def write(self, request, start, end):
        for layer, (k, v) in enumerate(self.layers):
            for kv, tensor in ((0, k), (1, v)):
                tensor.view(torch.int16)[request.idx, start:end] = pattern(
                    request, layer, kv, start, end, self.heads, self.dim, self.device)

    def verify(self, request):
        for layer, (k, v) in enumerate(self.layers):
            for kv, tensor in ((0, k), (1, v)):
                got = tensor.view(torch.int16)[request.idx, :request.length]
                want = pattern(request, layer, kv, 0, request.length, self.heads, self.dim, self.device)
                assert torch.equal(got, want), f"request {request.seq_id} layer {layer} kv {kv} lost tokens"

    def expect_zeros(self, request):
        for k, v in self.layers:
            assert not k[request.idx, :request.prompt_len].any() and not v[request.idx, :request.prompt_len].any(), (
                f"batch index {request.idx} shows a previous request's tokens")

    def release(self, request):
        vattention.free_batch_idx(request.idx)
        self.seq_lens[request.idx] = 0
        del self.peak_claim[request.idx]
        request.idx, request.length, request.generated = -1, 0, 0

    # -- the loop ----------------------------------------------------------------------

    def run(self, trace):
        waiting, running, iteration = [], [], 0
        pending = sorted(trace, key=lambda r: r.arrival)
        while pending or waiting or running:
            while pending and pending[0].arrival <= iteration:
                waiting.append(pending.pop(0))
            prefills = []
            for request in list(waiting):  # admission: the engine checks free blocks first
                needed = -(-(request.prompt_len + 1) // self.block_tokens)
                if vattention.num_free_kvblocks() < needed + len(running) + len(prefills):
                    break
                idx = vattention.alloc_new_batch_idx(request.prompt_len)
                if idx == -1:
                    self.counts["alloc_full"] += 1
                    break
                waiting.remove(request)
                request.idx = idx
                self.peak_claim[idx] = 0
                prefills.append(request)
            for request in running:
                request.length += 1
                self.seq_lens[request.idx] = request.length
            for request in prefills:
                request.length = request.prompt_len
                self.seq_lens[request.idx] = request.length
            batch = running + prefills
            while True:
                try:
                    vattention.step_async(self.seq_lens)
                    break
                except vkv.OutOfMemory:  # preempt the newest request, as a recompute-preempting engine does
                    self.counts["out_of_memory"] += 1
                    victim = batch.pop()
                    (prefills if victim in prefills else running).remove(victim)
                    self.release(victim)
                    waiting.insert(0, victim)
                    self.counts["preempted"] += 1
            for request in batch:
                self.peak_claim[request.idx] = max(self.peak_claim[request.idx], request.length)
            assert vattention.num_free_kvblocks() == self.expected_free_blocks()
            for request in prefills:
                self.expect_zeros(request)
                self.write(request, 0, request.length)
            for request in running:
                self.write(request, request.length - 1, request.length)
            running = batch
            for request in list(running):
                request.generated += 1
                if request.generated >= request.output_len:
                    self.verify(request)
                    self.release(request)
                    running.remove(request)
                    self.counts["finished"] += 1
                elif self.rng.random() < 0.02:  # a scheduler's preemption: recompute later
                    self.verify(request)
                    self.release(request)
                    running.remove(request)
                    waiting.insert(0, request)
                    self.counts["preempted"] += 1
            iteration += 1
        self.counts["iterations"] = iteration
        assert vattention.num_free_kvblocks() == self.budget_pages // self.pages_per_block
        return self.counts


MODES = [
    pytest.param(False, None, id="per_layer_tensors"),
    pytest.param(False, "interleaved", id="per_layer_tensors_on_interleaved"),
    pytest.param(True, None, id="megacache"),
]


@pytest.mark.parametrize("megacache, layout", MODES)
@pytest.mark.parametrize("device", DEVICES)
def test_an_engine_driver_runs_a_seeded_trace_and_every_token_reads_back(device, megacache, layout):
    if device == "cpu":
        engine = Engine("cpu", megacache, layout)
        trace = make_trace(seed=17, count=60, max_prompt=600, max_output=40)
    else:
        engine = Engine("cuda", megacache, layout, num_layers=4, heads=8, dim=128, max_batch=16, max_context=4096,
                        page_size=CUDA_PAGE, budget_pages=64 if megacache or layout else 96)
        trace = make_trace(seed=17, count=120, max_prompt=2500, max_output=60)
    counts = engine.run(trace)
    assert counts["finished"] == len(trace)
    assert counts["preempted"] > 0 and counts["out_of_memory"] + counts["alloc_full"] > 0  # the trace pressed memory
    vattention.kv_cache().check_invariants()


# -- the calls one by one -----------------------------------------------------------------


def test_init_returns_the_references_tensor_lists():
    kv = small_init()
    assert len(kv) == 4 and all(t.shape == (4, 1024, 2, 64) and t.dtype == torch.float16 for t in kv)
    assert all(t.is_contiguous() for t in kv)  # vAttention's per-layer tensors: vkv's per_layer layout
    cache = vattention.kv_cache()
    assert cache.layout == "per_layer"
    assert kv[1].data_ptr() == cache.key(1).data_ptr() and kv[3].data_ptr() == cache.value(1).data_ptr()


def test_megacache_tensors_are_views_of_the_interleaved_storage():
    k, v = small_init(megacache=True)
    assert k.shape == v.shape == (4, 1024, 2, 2, 64)
    cache = vattention.kv_cache()
    assert cache.layout == "interleaved"
    idx = vattention.alloc_new_batch_idx(10)
    vattention.step([10 if i == idx else 0 for i in range(4)], False)
    for layer in range(2):
        k[idx, :10, layer] = layer + 1
        v[idx, :10, layer] = -(layer + 1)
    for layer in range(2):
        assert torch.equal(cache.key(layer)[idx, :10], torch.full((10, 2, 64), layer + 1.0, dtype=torch.float16))
        assert torch.equal(cache.value(layer)[idx, :10], torch.full((10, 2, 64), -(layer + 1.0), dtype=torch.float16))


def test_alloc_returns_minus_one_when_every_index_is_taken_and_free_gives_one_back():
    small_init()
    ids = [vattention.alloc_new_batch_idx(5) for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3]
    assert vattention.alloc_new_batch_idx(5) == -1
    vattention.free_batch_idx(ids[2])
    assert vattention.alloc_new_batch_idx(5) == ids[2]


def test_free_blocks_count_pages_of_freed_ids_as_free():
    small_init()  # 2 layers: a block is 4 pages of 256 tokens each
    budget_blocks = vattention.reserve_physical_pages(32 * HOST_PAGE) // 4
    assert vattention.num_free_kvblocks() == budget_blocks == 8
    idx = vattention.alloc_new_batch_idx(300)
    lens = [0] * 4
    lens[idx] = 300  # 2 pages per tensor
    vattention.step(lens, True)
    assert vattention.num_free_kvblocks() == 6
    vattention.free_batch_idx(idx)
    assert vattention.num_free_kvblocks() == 8
    assert vattention.kv_cache().mapped_pages(idx) == 2  # kept for the next request (deferred reclamation)


def test_without_deferred_reclamation_freed_pages_go_back():
    small_init()
    vattention.set_deferred_reclamation(False)
    idx = vattention.alloc_new_batch_idx(300)
    vattention.step([300 if i == idx else 0 for i in range(4)], False)
    vattention.free_batch_idx(idx)
    assert vattention.kv_cache().mapped_pages(idx) == 0
    assert vattention.kv_cache().stats()["pages_created"] == 0


def test_a_freed_index_reads_zeros_for_its_next_request():
    kv = small_init()
    idx = vattention.alloc_new_batch_idx(100)
    vattention.step_async([100 if i == idx else 0 for i in range(4)])
    for tensor in kv:
        tensor[idx, :100] = 3
    vattention.free_batch_idx(idx)
    again = vattention.alloc_new_batch_idx(100)
    assert again == idx
    vattention.step_async([100 if i == idx else 0 for i in range(4)])
    assert not any(tensor[idx, :100].any() for tensor in kv)


def test_a_shortage_raises_out_of_memory_and_changes_nothing():
    small_init()
    vattention.reserve_physical_pages(4 * HOST_PAGE)  # one page per tensor
    a, b = vattention.alloc_new_batch_idx(10), vattention.alloc_new_batch_idx(10)
    lens = [0] * 4
    lens[a] = lens[b] = 10
    with pytest.raises(vkv.OutOfMemory, match=r"step_async: .* free_batch_idx\(\) or preempt") as shortage:
        vattention.step_async(lens)
    assert shortage.value.missing_pages == 4
    assert vattention.num_free_kvblocks() == 1
    lens[b] = 0
    vattention.step_async(lens)
    assert vattention.num_free_kvblocks() == 0


def test_map_common_pages_backs_every_allocated_index_and_keeps_seq_lens():
    small_init()
    a, b = vattention.alloc_new_batch_idx(1), vattention.alloc_new_batch_idx(1)
    vattention.step([5 if i == a else 0 for i in range(4)], False)
    vattention.map_common_pages(600)
    cache = vattention.kv_cache()
    assert cache.mapped_pages(a) == cache.mapped_pages(b) == 3
    assert cache.seq_lens()[a] == 5 and cache.seq_lens()[b] == 0


def test_errors_name_the_arguments_as_vattention_does():
    with pytest.raises(RuntimeError, match="init_kvcache"):
        vattention.alloc_new_batch_idx(1)
    with pytest.raises(ValueError, match="head_size = 0"):
        vattention.init_kvcache(2, 2, 0, 4, 1024, "cpu", torch.float16, HOST_PAGE, False)
    with pytest.raises(ValueError, match="max_context_length = -1"):
        vattention.init_kvcache(2, 2, 64, 4, -1, "cpu", torch.float16, HOST_PAGE, False)
    with pytest.raises(ValueError, match="page_size = 1000"):
        vattention.init_kvcache(2, 2, 64, 4, 1024, "cpu", torch.float16, 1000, False)
    with pytest.raises(ValueError, match="page_size = 1024"):  # below the OS page: the core's check
        vattention.init_kvcache(2, 2, 64, 4, 1024, "cpu", torch.float16, 1024, False)
    with pytest.raises(ValueError, match="dtype"):
        vattention.init_kvcache(2, 2, 64, 4, 1024, "cpu", "float16", HOST_PAGE, False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device = 0 names CUDA device 0, and none is visible"):
            vattention.init_kvcache(2, 2, 64, 4, 1024, 0, torch.float16, HOST_PAGE, False)
    small_init()
    with pytest.raises(RuntimeError, match="cleanup"):
        small_init()
    with pytest.raises(ValueError, match="seqlen = 2000 exceeds max_context_length = 1024"):
        vattention.alloc_new_batch_idx(2000)
    with pytest.raises(ValueError, match="idx = 2 is not allocated"):
        vattention.free_batch_idx(2)
    with pytest.raises(ValueError, match="idx = 9 is out of range: max_batch_size = 4"):
        vattention.free_batch_idx(9)
    with pytest.raises(ValueError, match=r"step_async: seq_lens\[1\] = 5 but batch index 1 is not allocated"):
        vattention.step_async([0, 5, 0, 0])
    with pytest.raises(ValueError, match="max_batch_size = 4"):
        vattention.step([0, 0], False)
    idx = vattention.alloc_new_batch_idx(1)
    lens = [0] * 4
    lens[idx] = 5000
    with pytest.raises(ValueError, match=rf"seq_lens\[{idx}\] = 5000 exceeds max_context_length = 1024"):
        vattention.step(lens, False)
    with pytest.raises(ValueError, match="bytes = 10 is less than one page"):
        vattention.reserve_physical_pages(10)
    with pytest.raises(ValueError, match="megacache"):
        vattention.cleanup()
        small_init(megacache=True, layout="per_layer")


def test_the_diagnostics_print_and_never_crash(capsys, caplog):
    small_init(megacache=True)
    vattention.show_kvcache_config()
    vattention.show_allocator_state()  # the reference crashes here
    out = capsys.readouterr().out
    assert "Num layers: 2" in out and "Max context length: 1024" in out
    assert "reqId : seqlen : mapped : required" in out
    idx = vattention.alloc_new_batch_idx(100)
    vattention.step([100 if i == idx else 0 for i in range(4)], True)
    vattention.show_allocator_state()
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("Free pool: ")
    assert [field.strip() for field in rows[2 + idx].split(":")] == [str(idx), "100", "2", "2"]
    vattention.set_verbose(True)
    with caplog.at_level("INFO", logger="vkv.vattention"):
        vattention.free_batch_idx(idx)
    assert f"free_batch_idx({idx})" in caplog.text


def test_cleanup_lets_a_process_init_again_and_held_tensors_stay_valid():
    kv = small_init()
    idx = vattention.alloc_new_batch_idx(10)
    vattention.step([10 if i == idx else 0 for i in range(4)], False)
    kv[0][idx, :10] = 1
    vattention.cleanup()
    assert kv[0][idx, :10].sum().item() == 10 * 2 * 64  # still mapped: the tensor holds the cache
    vattention.cleanup()  # idempotent
    assert len(small_init(device="auto" if not torch.cuda.is_available() else "cpu")) == 4


@needs_cuda
def test_an_integer_device_is_a_cuda_index():
    kv = vattention.init_kvcache(2, 8, 128, 4, 4096, 0, torch.bfloat16, CUDA_PAGE, False)
    assert kv[0].device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="page_size = 65536"):
        vattention.cleanup()
        vattention.init_kvcache(2, 8, 128, 4, 4096, 0, torch.bfloat16, 64 << 10, False)
