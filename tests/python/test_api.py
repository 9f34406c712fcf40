"""KVCache calls: step/free semantics, stats, errors and their messages, lifetime, module API."""

import gc
import inspect
import os

import numpy as np
import pytest
import torch

import vkv
from conftest import HOST_PAGE, lens, small_cache


def test_step_maps_pages_as_slots_grow_and_keeps_them_when_freed(device, layout):
    with small_cache(device, layout) as cache:
        per_page = cache.tokens_per_page
        regions = 1 if layout == "interleaved" else 8
        slot = cache.alloc_reqid()
        cache.step(lens(cache, s0=per_page + 1))
        assert cache.mapped_pages(slot) == 2
        stats = cache.stats()
        assert stats["pages_in_use"] == 2 * regions
        assert stats["active_slots"] == 1
        assert stats["tokens_in_use"] == per_page + 1
        assert stats["backend"]["map"]["units"] == 2 * regions
        cache.free_reqid(slot)
        stats = cache.stats()
        assert stats["pages_in_use"] == 0 and stats["pages_cached"] == 2 * regions
        assert cache.alloc_reqid() == slot  # the slot that kept its pages goes out first
        cache.check_invariants()


def test_a_reused_slot_reads_zeros_through_its_tensors(device, layout):
    with small_cache(device, layout) as cache:
        slot = cache.alloc_reqid()
        cache.step(lens(cache, s0=1000))
        for layer in range(cache.num_layers):
            cache.key(layer)[slot, :1000] = 7
            cache.value(layer)[slot, :1000] = 7
        cache.free_reqid(slot)
        assert cache.alloc_reqid() == slot
        cache.step(lens(cache, s0=1000))
        for layer in range(cache.num_layers):
            assert not cache.key(layer)[slot, :1000].any()
            assert not cache.value(layer)[slot, :1000].any()


@pytest.mark.parametrize(
    "as_input", [list, np.array, lambda x: np.array(x, dtype=np.uint32), torch.tensor], ids=["list", "numpy", "uint32", "tensor"]
)
def test_step_accepts_lists_arrays_and_tensors(as_input):
    with small_cache() as cache:
        cache.alloc_reqid()
        cache.step(as_input([10, 0, 0, 0]))
        assert cache.stats()["tokens_in_use"] == 10


def test_a_shortage_raises_out_of_memory_with_the_shortfall_and_changes_nothing(layout):
    regions = 1 if layout == "interleaved" else 8
    with small_cache(layout=layout, memory_budget=2 * regions * HOST_PAGE) as cache:
        per_page = cache.tokens_per_page
        a, b = cache.alloc_reqid(), cache.alloc_reqid()
        cache.step(lens(cache, s0=per_page))
        before = cache.stats()
        with pytest.raises(vkv.OutOfMemory) as raised:  # 3 pages per region, budget 2
            cache.step(lens(cache, s0=per_page, s1=2 * per_page))
        error = raised.value
        assert isinstance(error, MemoryError)
        assert error.missing_pages == regions
        assert error.missing_bytes == regions * HOST_PAGE
        assert "budget" in str(error)
        after = cache.stats()
        for key in ("pages_created", "pages_in_use", "tokens_in_use", "pages_mapped"):
            assert after[key] == before[key]
        assert cache.mapped_pages(b) == 0
        cache.check_invariants()
        cache.free_reqid(b)  # preempt b: now a can grow
        cache.step(lens(cache, s0=2 * per_page))
        assert cache.mapped_pages(a) == 2


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.step([1, 0, 0]), "max_batch_size = 4"),
        (lambda c: c.step([[1, 0, 0, 0]]), "one-dimensional"),
        (lambda c: c.step([-1, 0, 0, 0]), "negative"),
        (lambda c: c.step([1.5, 0, 0, 0]), "integers"),
        (lambda c: c.step(torch.tensor([1.0, 0, 0, 0])), "integers"),
        (lambda c: c.step([5000, 0, 0, 0]), "exceeds max_context_len = 4096"),
        (lambda c: c.step([0, 3, 0, 0]), "slot 1 is not allocated"),
        (lambda c: c.free_reqid(1), "double free"),
        (lambda c: c.free_reqid(4), "out of range"),
        (lambda c: c.free_reqid(-1), "out of range"),
        (lambda c: c.free_reqid("0"), "must be an int"),
        (lambda c: c.key(4), "layer = 4 is out of range"),
        (lambda c: c.value(-1), "out of range"),
        (lambda c: c.mapped_pages(9), "slot = 9"),
    ],
)
def test_bad_calls_raise_value_error_naming_the_value_and_change_nothing(call, message):
    with small_cache() as cache:
        cache.alloc_reqid()
        cache.step([5, 0, 0, 0])
        before = cache.stats()
        with pytest.raises(ValueError, match=message):
            call(cache)
        after = cache.stats()
        assert (after["tokens_in_use"], after["active_slots"], after["pages_mapped"]) == (5, 1, before["pages_mapped"])
        cache.check_invariants()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_layers=0), "num_layers = 0"),
        (dict(num_kv_heads=-2), "num_kv_heads = -2"),
        (dict(head_dim=1.5), "head_dim"),
        (dict(dtype="float16"), "torch.dtype"),
        (dict(dtype=torch.complex128), "dtype = torch.complex128 is not supported: elements must be 1, 2, 4 or 8 bytes"),
        (dict(layout="paged"), "layout"),
        (dict(device="tpu"), "device"),
        (dict(max_batch_size=0), "max_batch_size = 0"),
        (dict(max_context_len=2**32, max_batch_size=10**5), "virtual address space"),
        (dict(layers_per_group=3), "layers_per_group = 3"),
        (dict(page_size=3 << 16), "page_size = 196608"),
        (dict(memory_budget=0), "memory_budget"),
        (dict(memory_budget=100), "less than one page"),
    ],
)
def test_bad_configs_raise_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_cache(**overrides)


def test_alloc_when_full_raises_value_error():
    with small_cache() as cache:
        assert sorted(cache.alloc_reqid() for _ in range(4)) == [0, 1, 2, 3]
        assert cache.num_free_slots == 0
        with pytest.raises(ValueError, match="no free slot"):
            cache.alloc_reqid()


@pytest.mark.skipif(vkv.cuda_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_is_refused_clearly():
    with pytest.raises(ValueError, match="needs (a )?CUDA"):  # no device, or no CUDA backend in the build
        small_cache(device="cuda")


def test_a_closed_cache_refuses_calls_but_its_tensors_stay_valid(device):
    cache = small_cache(device)
    slot = cache.alloc_reqid()
    cache.step(lens(cache, s0=64))
    key = cache.key(0)
    key[slot, :64] = 2.0
    cache.close()
    cache.close()  # idempotent
    assert cache.closed
    # The lambdas run before the `del cache` below, which ruff reads as unbinding it first
    for call in (cache.alloc_reqid, cache.stats, lambda: cache.step([0] * 4), lambda: cache.key(0)):  # noqa: F821
        with pytest.raises(RuntimeError, match="closed"):
            call()
    del cache
    gc.collect()
    # The storage holds the memory: still mapped, still ours.
    assert key[slot, :64].sum().item() == 2.0 * 64 * 2 * 64
    key[slot, :64] = 3.0
    assert key[slot, 0, 0, 0].item() == 3.0


def test_memory_goes_back_when_the_last_tensor_dies():
    cache = small_cache()
    cache.alloc_reqid()
    cache.step([4096, 0, 0, 0])
    core = cache._core  # only to observe the C++ object's lifetime
    import weakref

    key = cache.key(0)
    cache.close()
    assert core is not None
    del core
    referent = weakref.ref(key)
    del key
    gc.collect()
    assert referent() is None


def test_module_level_api_in_the_papers_shape():
    with pytest.raises(RuntimeError, match="init"):
        vkv.alloc_reqid()
    k_cache, v_cache = vkv.init(
        num_layers=2, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16, max_batch_size=2, max_context_len=512, device="cpu"
    )
    try:
        assert len(k_cache) == len(v_cache) == 2
        assert k_cache[0].shape == (2, 512, 1, 64)
        with pytest.raises(RuntimeError, match="already"):
            vkv.init(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, max_batch_size=1, max_context_len=8, device="cpu")
        reqid = vkv.alloc_reqid()
        vkv.step([100 if s == reqid else 0 for s in range(2)])
        k_cache[1][reqid, :100] = 1
        assert vkv.stats()["tokens_in_use"] == 100
        vkv.free_reqid(reqid)
        assert vkv.default_cache().num_free_slots == 2
    finally:
        vkv.shutdown()
    vkv.shutdown()
    with pytest.raises(RuntimeError):
        vkv.step([0, 0])


def test_repr_and_properties():
    with small_cache() as cache:
        assert "4 of 4 slots free" in repr(cache)
        assert cache.page_size == HOST_PAGE
        assert cache.tokens_per_page == HOST_PAGE // (4 * 2 * 2 * 64 * 2)
        assert cache.reserved_bytes == 4 * 4096 * 4 * 2 * 2 * 64 * 2
    assert "closed" in repr(cache)


def test_driver_error_is_a_runtime_error():
    assert issubclass(vkv.DriverError, RuntimeError)
    error = vkv.DriverError("cuMemMap failed: CUDA_ERROR_INVALID_VALUE (1)", "cuMemMap", 1)
    assert error.call == "cuMemMap" and error.code == 1


@pytest.mark.parametrize(
    "seq_lens, message",
    [
        (np.array([1.0, 0, 0, 0]), "integers"),
        (np.array([True, False, False, False]), "integers"),
        ([1, 0, 0, 2**70], "64 bits"),
        ([1, 0, 0, True], "not an integer"),
        ("abcd", "list, tuple, numpy array or tensor"),
        (np.zeros((2, 2), dtype=np.int64), "one-dimensional"),
        (np.array([1, 0, 0, 2**63], dtype=np.uint64), "too large"),
    ],
)
def test_step_rejects_seq_lens_that_are_not_non_negative_integers(seq_lens, message):
    with small_cache() as cache:
        cache.alloc_reqid()
        with pytest.raises(ValueError, match=message):
            cache.step(seq_lens)


def test_step_reads_every_integer_width_and_strided_arrays():
    with small_cache() as cache:
        cache.alloc_reqid()
        for seq_lens in (np.array([5, 0, 0, 0], dtype=np.int16), np.array([6, 0, 0, 0], dtype=np.uint8),
                         np.arange(8, dtype=np.int64)[::2] * 0 + np.array([7, 0, 0, 0]), (8, 0, 0, 0),
                         torch.tensor([9, 0, 0, 0], dtype=torch.int32)):
            cache.step(seq_lens)
            assert cache.stats()["tokens_in_use"] == int(seq_lens[0])
        assert cache.stats()["step"]["calls"] == 5


def test_the_last_step_profile_says_what_the_step_did():
    with small_cache(background_mapping=False, eager_tokens=0) as cache:
        slot = cache.alloc_reqid()
        cache.step(lens(cache, **{f"s{slot}": 100}))
        first = cache.last_step_profile()
        assert first["pages_mapped"] > 0 and first["fills"] == 0 and first["mapper_waits"] == 0
        assert first["total_ns"] >= first["lock_wait_ns"] + first["map_ns"]
        assert first["alloc_ns"] > 0 and first["free_ns"] == 0  # the last alloc_reqid(); no free_reqid yet
        cache.free_reqid(slot)
        assert cache.alloc_reqid() == slot  # it kept its pages, and its zero-fill is deferred
        cache.step(lens(cache, **{f"s{slot}": 50}))
        second = cache.last_step_profile()
        assert second["fills"] == 1 and second["pages_mapped"] == 0 and second["free_ns"] > 0
        assert not second["lock_contended"] and not second["mapper_busy"]


# -- the constructor's parameters come from the config fields (include/vkv/config.h) --------

PYTHON_VALUED = {"dtype_bytes": "dtype", "device": "device", "memory_budget": "memory_budget", "eager_tokens": "eager_tokens"}


def test_the_signature_has_every_config_field_with_its_default():
    from vkv import _C

    parameters = inspect.signature(vkv.KVCache).parameters
    fields = _C.CacheConfig.fields()
    assert len(parameters) == len(fields)
    for name, python_type, default, meaning in fields:
        assert PYTHON_VALUED.get(name, name) in parameters, name
        if name not in PYTHON_VALUED and parameters[name].kind == inspect.Parameter.KEYWORD_ONLY:
            assert parameters[name].default == default, name
            assert parameters[name].annotation.__name__ == python_type, name
    assert list(parameters)[:8] == ["num_layers", "num_kv_heads", "head_dim", "dtype", "max_batch_size",
                                    "max_context_len", "device", "layout"]
    assert parameters["device"].default == "auto" and parameters["layout"].default == "interleaved"
    assert parameters["memory_budget"].default is None and parameters["eager_tokens"].default is None
    assert inspect.signature(vkv.init).parameters.keys() == parameters.keys()


def test_the_docstring_documents_every_parameter():
    doc = vkv.KVCache.__init__.__doc__
    for name in inspect.signature(vkv.KVCache).parameters:
        assert f"\n            {name}: " in doc, name
    assert "{args}" not in doc


def test_an_unknown_keyword_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown keyword argument 'page_bytes': the keywords are num_layers, .*zero_page"):
        small_cache(page_bytes=HOST_PAGE)
    with pytest.raises(ValueError, match="'dtype_bytes'"):  # the core's field; Python passes a dtype
        small_cache(dtype_bytes=2)
    with pytest.raises(TypeError, match=r"vkv.KVCache\(\): missing a required argument: 'max_context_len'"):
        vkv.KVCache(1, 1, 8, torch.float16, 1)


def test_every_keyword_option_reaches_the_core():
    page = HOST_PAGE
    budget = vkv.SharedBudget.create(f"test-api-{os.getpid()}", 64 * page, device="cpu")
    options = dict(layers_per_group=2, page_size=page, memory_budget=8 * page, precreate_pages=1, large_page_size=2 * page,
                   zero_page=True, scratch_page=True, checked=True,
                   background_mapping=False, lookahead_tokens=7, eager_tokens=5, deferred_reclamation=False,
                   reclaim_watermark_pages=3, backend_statistics=False, shared_budget=budget.name,
                   shared_budget_idle_ms=9, shared_budget_pressure_ms=11, shared_budget_floor=2 * page,
                   shared_budget_cap=16 * page, shared_budget_priority=3, shared_budget_label="api")
    keywords = [p.name for p in inspect.signature(vkv.KVCache).parameters.values() if p.kind == p.KEYWORD_ONLY]
    assert sorted(options) == sorted(keywords), "a new config field: give it a value here"
    with vkv.KVCache(4, 2, 64, torch.float16, 4, 4096, "cpu", "interleaved", **options) as cache:
        config = cache._core.config
        for name, value in options.items():
            assert getattr(config, name) == value, name
        assert (config.dtype_bytes, config.device, config.layout) == (2, "cpu", "interleaved")
    budget.remove()
    with small_cache() as cache:  # the Python defaults: None for memory_budget and eager_tokens
        assert (cache._core.config.memory_budget, cache._core.config.eager_tokens) == (0, vkv._C.ADAPTIVE)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(zero_page="no"), "zero_page = 'no' must be a bool"),
        (dict(lookahead_tokens=-1), "lookahead_tokens = -1 must be >= 0"),
        (dict(eager_tokens=2.5), "eager_tokens = 2.5 must be an int"),
        (dict(layout=3), "layout = 3 must be a str"),
        (dict(page_size=2**64), "page_size = 18446744073709551616 does not fit 64 bits"),
        (dict(memory_budget=-5), "memory_budget = -5 must be >= 1"),
    ],
)
def test_option_types_are_checked_naming_the_option(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_cache(**overrides)


def test_the_config_binding_takes_keywords_and_names_its_fields():
    from vkv import _C

    config = _C.CacheConfig(num_layers=2, device="cuda:1", layout="per_layer")
    assert (config.num_layers, config.device, config.layout, config.eager_tokens) == (2, "cuda:1", "per_layer", _C.ADAPTIVE)
    config.zero_page = False
    assert "zero_page=False" in repr(config)
    with pytest.raises(ValueError, match="CacheConfig has no field 'max_batch': its fields are num_layers"):
        _C.CacheConfig(max_batch=2)
    with pytest.raises(ValueError, match="device = 'host' is not a device: expected 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        _C.CacheConfig(device="host")
    assert _C.CacheConfig(device="cpu").device == "cpu"


# -- messages speak the caller's names, never the core's own -----------------------------

CORE_ONLY_WORDS = ["dtype_bytes", "backend 'host'", "'host',", "'host' or", "page_bytes", "budget_bytes", "max_batch ", "max_batch =", "max_context ",
                   "max_context =", "reqid =", "kAdaptive", "18446744073709551615", "(bytes", " bytes = ", " tokens = ",
                   "step_slots"]


def bad_constructions():
    yield lambda: small_cache(dtype=torch.complex128)
    yield lambda: small_cache(max_context_len=2**32, max_batch_size=10**5)
    yield lambda: small_cache(page_size=1024)
    yield lambda: small_cache(precreate_pages=10**6, memory_budget=8 * HOST_PAGE)
    yield lambda: small_cache(memory_budget=100)
    yield lambda: small_cache(device="host")
    yield lambda: small_cache(layout="per_layer", layers_per_group=2)
    yield lambda: small_cache(eager_tokens=-1)


def bad_calls(cache, slot):
    other = cache.alloc_reqid()
    yield lambda: cache.set_budget(100)
    yield lambda: cache._prepare_set_budget(100)
    yield lambda: cache.share_prefix(slot, other, 50)
    yield lambda: cache._prepare_share_prefix(slot, other, 50)
    yield lambda: cache.share_prefix(slot, slot, 1)
    yield lambda: cache.fork(3)
    yield lambda: cache.swap_in(slot)
    yield lambda: cache.free_reqid(3)
    yield lambda: cache.alloc_reqids(9)
    yield lambda: cache.step({7: 1})
    yield lambda: cache.step({slot: 10**6})
    yield lambda: cache.step([1, 2, 3])
    yield lambda: cache.mapped_pages(9)


def test_no_message_shows_a_name_only_the_core_uses():
    messages = []
    for call in bad_constructions():
        with pytest.raises(ValueError) as raised:
            call()
        messages.append(str(raised.value))
    with small_cache() as cache:
        slot = cache.alloc_reqid()
        cache.step([10, 0, 0, 0])
        for call in bad_calls(cache, slot):
            with pytest.raises(ValueError) as raised:
                call()
            messages.append(str(raised.value))
        cache.check_invariants()
    for message in messages:
        for word in CORE_ONLY_WORDS:
            assert word not in message, f"{word!r} in {message!r}"
    said = "\n".join(messages)
    for words in ("dtype = torch.complex128", "device 'cpu' can reserve", "set_budget: memory_budget = 100",
                  "share_prefix: n_tokens = 50 exceeds"):
        assert words in said


def test_module_level_calls_name_the_slot():
    vkv.init(1, 1, 8, torch.float16, 2, 64, "cpu")
    try:
        with pytest.raises(ValueError, match="slot = 5 is out of range: max_batch_size = 2"):
            vkv.free_reqid(slot=5)
    finally:
        vkv.shutdown()
