"""Checked mode (checked=True, VKV_CHECKED=1): a bad access says what it is.

On the host backend an access to memory no step() backed for the slot's current owner ends
the process (SIGABRT) with one line naming the slot, the token, the layer and the cause, and
Python's faulthandler prints the Python line. Each case runs in a fresh interpreter. The
default mode's behaviour, which docs/api.md's table states next to it, is pinned here too.
Legal use is unchanged: a subset of the suite's tensor tests runs here with VKV_CHECKED=1.
"""

import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

import vkv
from conftest import HOST_PAGE, needs_cuda, run_python, small_cache

# Legal use in checked mode: these tests run again in this module, where every cache is checked.
from test_api import test_a_reused_slot_reads_zeros_through_its_tensors  # noqa: F401
from test_tensors import (  # noqa: F401
    test_a_write_through_a_view_is_read_through_another_view_of_the_same_memory,
    test_both_layouts_show_the_same_values,
    test_every_dtype_round_trips,
    test_sdpa_on_vkv_tensors_equals_sdpa_on_plain_tensors_cpu,
)
from test_view_copies import (  # noqa: F401
    test_views_of_backed_tokens_copy_only_what_they_cover,
    test_views_over_unmapped_memory_raise_instead_of_crashing,
)
from test_zero_page import (  # noqa: F401
    test_a_padded_batch_reads_zeros_beyond_each_request_and_matches_sdpa_with_a_mask,
    test_a_slots_view_is_its_backed_tokens_and_safe_to_read_whole,
)


@pytest.fixture(autouse=True)
def _every_cache_checked(monkeypatch):
    monkeypatch.setenv("VKV_CHECKED", "1")


def run_with_a_slot(action: str, device: str = "cpu", layout: str = "interleaved", checked: bool = True,
                    **options) -> subprocess.CompletedProcess:
    """Runs `action` after making a cache (4 layers) whose slot `slot` holds 100 tokens."""
    extra = "".join(f", {name}={value!r}" for name, value in options.items())
    code = textwrap.dedent(f"""
        import torch, vkv
        cache = vkv.KVCache(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                            max_context_len=4096, device={device!r}, layout={layout!r}, background_mapping=False,
                            checked={checked!r}{extra})
        slot = cache.alloc_reqid()
        cache.step({{slot: 100}})
    """) + textwrap.dedent(action)
    return run_python(code, VKV_CHECKED="0")


# A view of the slot kept past free_reqid(), written through (one line per statement, no indent).
WRITE_THROUGH_A_FREED_VIEW = """
view = cache.key(0)[slot]
cache.free_reqid(slot)
view[5] = 1
"""


def expect_report(result, *fragments: str) -> None:
    """The process aborted with vkv's line, holding every fragment, and the Python line."""
    assert result.returncode == -signal.SIGABRT, (result.returncode, result.stdout, result.stderr)
    report = [line for line in result.stderr.splitlines() if line.startswith("vkv checked mode: ")]
    assert len(report) == 1, result.stderr
    for fragment in fragments:
        assert fragment in report[0], (fragment, report[0])
    assert report[0].endswith(" (aborting)")
    assert 'File "<string>", line' in result.stderr, "faulthandler names the Python line"


@pytest.mark.parametrize("layout", ["interleaved", "per_layer"])
def test_a_write_past_step_names_the_slot_the_token_and_the_layer(layout):
    result = run_with_a_slot("cache.key(1)[slot, 3000] = 1", layout=layout, page_size=HOST_PAGE)
    expect_report(result, "vkv checked mode: a write at 0x", "hit slot 0, token 3000, layer 1 K of the host cache at 0x",
                  f"({layout}): slot 0 has 100 tokens backed by step(); step() it to 3001 tokens or more before "
                  "writing token 3000")


def test_a_read_past_step_faults_with_how_to_read():
    result = run_with_a_slot("print(float((cache.value(2)[slot, 3000] + 0).sum()))")
    expect_report(result, "a read at 0x", "hit slot 0, token 3000, layer 2 V",
                  "to read, use one request's tokens, key(layer, slot), not a whole view, or build the cache with "
                  "zero_page=True")


def test_a_whole_view_read_stops_at_the_first_unbacked_byte():
    # torch's worker threads read the view side by side: each faults, one reports (as on a 16-core host)
    result = run_with_a_slot("torch.set_num_threads(8); print(float(cache.key(0).float().sum()))")
    expect_report(result, "a read at 0x", "layer 0 K", "key(layer, slot), not a whole view")


@pytest.mark.parametrize("deferred_reclamation", [True, False])
def test_a_write_through_a_freed_slots_view_says_the_slot_is_free(deferred_reclamation):
    result = run_with_a_slot(WRITE_THROUGH_A_FREED_VIEW, deferred_reclamation=deferred_reclamation)
    expect_report(result, "a write at 0x", "hit slot 0, token 5, layer 0 K",
                  "slot 0 is free (free_reqid()): a view kept from its last request must not be used; write through "
                  "the slot alloc_reqid() hands out, after step()")


def test_the_environment_turns_it_on_for_a_cache_that_did_not_ask():
    result = run_python("""
        import torch, vkv
        cache = vkv.KVCache(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, max_batch_size=2,
                            max_context_len=65536, device="cpu", background_mapping=False)
        assert cache._core.config.checked
        cache.key(0)[1, 7] = 1.0
    """, VKV_CHECKED="1")
    expect_report(result, "hit slot 1, token 7, layer 0 K", "slot 1 is not allocated")
    refused = run_python("import torch, vkv; vkv.KVCache(1, 1, 8, torch.float32, 2, 64, 'cpu')", VKV_CHECKED="on")
    assert refused.returncode == 1 and "ValueError: VKV_CHECKED = 'on' is not a setting" in refused.stderr


# ---- the default mode, as docs/api.md's table states it ---------------------------------


def test_with_the_defaults_a_write_past_step_is_a_bare_segmentation_fault():
    result = run_with_a_slot("cache.key(1)[slot, 3000] = 1", checked=False)
    assert result.returncode == -signal.SIGSEGV and "vkv checked mode" not in result.stderr


def test_with_the_defaults_a_write_through_a_freed_slots_view_is_accepted_and_lost():
    result = run_with_a_slot(WRITE_THROUGH_A_FREED_VIEW + textwrap.dedent("""
        again = cache.alloc_reqid()
        cache.step({again: 100})
        print(again == slot, float(cache.key(0, again)[5].abs().sum()))
    """), checked=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "0.0"], "the next owner sees zeros, not the stale write"


def test_with_the_defaults_and_no_deferred_reclamation_a_freed_slots_view_faults_bare():
    result = run_with_a_slot(WRITE_THROUGH_A_FREED_VIEW, checked=False, deferred_reclamation=False)
    assert result.returncode == -signal.SIGSEGV and "vkv checked mode" not in result.stderr


# ---- explaining an address ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["interleaved", "per_layer"])
def test_explain_names_the_slot_the_token_and_the_layer_of_an_address(layout):
    with small_cache(layout=layout) as cache:
        slot = cache.alloc_reqid()
        cache.step({slot: 10})
        address = cache.value(2)[slot, 700].data_ptr()
        explained = cache.explain(address)
        assert f"is slot {slot}, token 700, layer 2 V of the host cache at 0x{cache._core.base:x} ({layout})" in explained
        assert "has 10 tokens backed by step()" in explained
        assert vkv.explain_address(hex(address)) == explained == vkv.explain_address(address)
        assert "is not in this cache's reservation" in cache.explain(cache._core.base + cache.reserved_bytes)
    assert "is in no live vkv cache's reservation" in vkv.explain_address(address)
    with pytest.raises(ValueError, match="address = 'nowhere' is not an address"):
        vkv.explain_address("nowhere")


def test_checked_mode_keeps_no_pages_for_freed_slots(device):
    with small_cache(device, lookahead_tokens=256) as cache:
        assert cache._core.config.checked, "VKV_CHECKED=1"
        slot = cache.alloc_reqid()
        cache.step({slot: 10})
        cache.map_ahead_now()
        assert cache.mapped_pages(slot) == 1, "nothing mapped ahead"
        cache.free_reqid(slot)
        assert cache.mapped_pages(slot) == 0
        assert "slot 0 is free (free_reqid())" in cache.explain(cache.key(0)[slot, 0].data_ptr())


# ---- CUDA: the GPU names no address; checked mode makes a freed slot's access fault ---


@needs_cuda
def test_on_cuda_checked_mode_says_how_to_name_a_faulting_address():
    result = run_with_a_slot("print(cache.explain(cache.key(1)[slot, 3000].data_ptr()))", device="cuda")
    assert result.returncode == 0, result.stderr
    assert "vkv checked mode: the cuda:0 cache reserves [0x" in result.stderr
    assert "run under compute-sanitizer and pass the address it reports to vkv.explain_address()" in result.stderr
    assert "is slot 0, token 3000, layer 1 K of the cuda:0 cache" in result.stdout


@needs_cuda
@pytest.mark.parametrize("checked", [False, True])
def test_on_cuda_a_write_through_a_freed_slots_view_faults_only_in_checked_mode(checked):
    result = run_with_a_slot(WRITE_THROUGH_A_FREED_VIEW + textwrap.dedent("""
        torch.cuda.synchronize()
        print("accepted")
    """), device="cuda", checked=checked)
    if checked:
        assert result.returncode != 0 and "CUDA error" in result.stderr, result.stderr  # an illegal memory access
    else:
        assert result.returncode == 0 and result.stdout.split() == ["accepted"], result.stderr


@needs_cuda
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not installed")
def test_on_cuda_the_address_compute_sanitizer_reports_is_explained(tmp_path):
    # compute-sanitizer writes its log when the process ends, after the cache is gone: the
    # process explains the row it is about to write (any of its bytes), and the addresses the
    # sanitizer reports must all lie in that row.
    log = tmp_path / "memcheck.log"
    code = textwrap.dedent("""
        import torch, vkv
        cache = vkv.KVCache(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=4,
                            max_context_len=4096, device="cuda", background_mapping=False, checked=True)
        slot = cache.alloc_reqid()
        cache.step({slot: 100})
        row = cache.key(1)[slot, 3000]
        start, size = row.data_ptr(), row.numel() * row.element_size()
        print(hex(start), size, vkv.explain_address(hex(start + size - 1)), flush=True)
        try:
            row.fill_(1)
            torch.cuda.synchronize()
        except RuntimeError:
            pass  # the context is gone; the process and the cache's books are not
    """)
    result = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--log-file", str(log), sys.executable, "-c",
                             code], capture_output=True, text=True, timeout=300)
    report = log.read_text() if log.exists() else ""
    start, size, explanation = result.stdout.split(" ", 2)
    assert "is slot 0, token 3000, layer 1 K of the cuda:0 cache" in explanation, (result.stdout, result.stderr)
    # "Address 0x... is out of bounds" or "Access to 0x... is out of bounds", by the sanitizer's release
    reported = [int(address, 16) for address in re.findall(r"(?:Address|Access to) (0x[0-9a-f]+)", report)]
    assert reported, report[-3000:]
    assert all(int(start, 16) <= address < int(start, 16) + int(size) for address in reported), report[-3000:]
