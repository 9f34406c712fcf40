"""Printing, pickling, deep-copying and saving the cache's tensors: with
the default zero_page=False most of the reservation a ``key(l)`` views has no page, and
reading it faults on a GPU (the host backend reads zeros, but the checks act alike on
both). These calls must copy only what the
view covers when pages back all of it, and raise a clear error otherwise; the process must
never die. Each check runs in a subprocess, so that a crash fails the test instead of
killing pytest."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent

PRELUDE = """
import copy, io, pickle, sys
import torch
sys.path.insert(0, {here!r})
from conftest import small_cache
cache = small_cache({device!r}, layout={layout!r})
slot = cache.alloc_reqid()
cache.step([100] + [0] * 3)
with torch.no_grad():
    for layer in range(cache.num_layers):
        cache.key(layer)[slot, :100] = layer + 1
        cache.value(layer)[slot, :100] = -(layer + 1)
# 100 tokens of the slot past the pages its 100 tokens claim: no page backs them.
first = -(-100 // cache.tokens_per_page) * cache.tokens_per_page
unbacked = slice(first, first + 100)
"""


def run(body, layout="interleaved", device="cpu"):
    """Runs `body` after the prelude in a fresh interpreter; returns its stdout."""
    script = PRELUDE.format(here=str(HERE), layout=layout, device=device) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode} (negative: killed by a signal)\n{done.stderr}"
    return done.stdout


LAYOUTS = ["interleaved", "per_layer"]


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The host backend always; CUDA where there is a GPU (an unbacked read there would end
    the CUDA context: the same checks must hold)."""
    if request.param == "cuda":
        import torch
        import vkv

        if not (vkv.cuda_available() and torch.cuda.is_available()):
            pytest.skip("no CUDA device")
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_of_backed_tokens_copy_only_what_they_cover(layout, device):
    out = run("""
        view = cache.key(1)[slot, :100]
        data = pickle.dumps(view)
        assert len(data) < 100_000, len(data)  # the view's 25 KiB, not the reservation
        back = pickle.loads(data)
        expected = torch.full((100, 2, 64), 2.0, dtype=torch.float16, device=cache.device)
        assert type(back) is torch.Tensor and torch.equal(back, expected)
        deep = copy.deepcopy(view)
        assert type(deep) is torch.Tensor and torch.equal(deep, back)
        assert deep.untyped_storage().nbytes() == 100 * 2 * 64 * 2
        buffer = io.BytesIO()
        torch.save({"k": view, "v": cache.value(1)[slot, :100]}, buffer)
        assert buffer.tell() < 200_000, buffer.tell()
        buffer.seek(0)
        loaded = torch.load(buffer)
        assert torch.equal(loaded["k"], back) and torch.equal(loaded["v"], -back)
        assert "2." in repr(view) and "tensor(" in repr(view)
        assert "2." in str(cache.key(1)[slot, 5]) and f"{cache.key(1)[slot, 0, 0, 0]:.1f}" == "2.0"
        assert cache.key(1)[slot, :100, 0, 0].tolist() == [2.0] * 100
        assert cache.key(1)[slot].narrow(0, 0, 10).cpu().shape == (10, 2, 64)
        print("ok")
    """, layout, device)
    assert out.strip() == "ok"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_over_unmapped_memory_raise_instead_of_crashing(layout, device):
    out = run("""
        whole = cache.key(0)
        text = repr(whole)  # the debugging print of a whole layer: never a crash
        assert text.startswith(f"<vkv cache view: shape=[4, {cache.max_context_len}, 2, 64]"), text
        assert "not printed" in text, text
        assert "zero_page=False" in str(whole)
        for what, call in [("pickling", lambda: pickle.dumps(whole)),
                           ("pickling", lambda: pickle.dumps(cache.key(0)[slot])),
                           ("copy.deepcopy", lambda: copy.deepcopy(cache.value(2)[1:, :10])),
                           ("pickling", lambda: torch.save(cache.key(3)[slot, unbacked], io.BytesIO())),
                           ("tolist()", lambda: cache.key(0)[2].tolist())]:
            try:
                call()
            except RuntimeError as error:
                assert str(error).startswith(what) and "no page backs" in str(error), error
            else:
                raise AssertionError(f"{what} of unmapped memory did not raise")
        if cache.device.type == "cuda":
            torch.cuda.synchronize()  # the context is alive: nothing read unmapped memory
        print("ok")
    """, layout, device)
    assert out.strip() == "ok"


def test_views_after_close_and_plain_results_stay_safe():
    out = run("""
        view = cache.key(1)[slot, :100]
        doubled = view * 2  # arithmetic: a plain tensor of its own
        assert type(doubled) is torch.Tensor and pickle.loads(pickle.dumps(doubled))[0, 0, 0] == 4.0
        whole = cache.key(0)
        cache.close()
        del cache
        # The views keep the memory (and what tells backed from unbacked) past close().
        assert torch.equal(pickle.loads(pickle.dumps(view)), torch.full((100, 2, 64), 2.0, dtype=torch.float16))
        assert "not printed" in repr(whole)
        try:
            pickle.dumps(whole)
        except RuntimeError as error:
            assert "no page backs" in str(error), error
        else:
            raise AssertionError("pickled unmapped memory after close()")
        print("ok")
    """)
    assert out.strip() == "ok"


def test_with_zero_page_every_view_prints_and_copies_in_full():
    out = run("""
        zeroed = small_cache(zero_page=True)
        a = zeroed.alloc_reqid()
        zeroed.step([10, 0, 0, 0])
        assert "tensor(" in repr(zeroed.key(0)[:, :2, 0, :2])
        assert copy.deepcopy(zeroed.key(0)[3, 4000:]).abs().sum().item() == 0
        print("ok")
    """)
    assert out.strip() == "ok"
