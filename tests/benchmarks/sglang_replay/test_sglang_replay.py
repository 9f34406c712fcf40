"""benchmarks/sglang_replay/sglang_replay.py runs (its timings are not checked): a trace of SGLang-shaped
steps (pages backed, given back and backed anew between forwards) replays over vkv memory
and a fixed pool on the CPU with torch's attention, bitwise equal."""

import json

import pytest

import vkv

pytestmark = pytest.mark.skipif(not hasattr(vkv, "BlockBacking"), reason="needs vkv.BlockBacking")


def _trace(path):
    page = 16
    steps = []
    # two requests prefill 40 and 20 tokens on pages 1-3 and 4-5, decode 3 steps, then the
    # first finishes, its pages go back, a third request prefills on newly backed pages 6-8
    first, second = [p * page + t for p in (1, 2, 3) for t in range(page)][:40], \
        [p * page + t for p in (4, 5) for t in range(page)][:20]
    steps.append({"decode": False, "backed": [0, 1, 2, 3, 4, 5], "requests": [[first, 40], [second, 20]]})
    for i in range(3):
        first.append(first[-1] + 1)
        second.append(second[-1] + 1)
        steps.append({"decode": True, "backed": [0, 1, 2, 3, 4, 5], "requests": [[list(first), 1], [list(second), 1]]})
    third = [p * page + t for p in (6, 7, 8) for t in range(page)][:33]
    steps.append({"decode": False, "backed": [0, 4, 5, 6, 7, 8], "requests": [[third, 33], [list(second), 1]]})
    from benchmarks.sglang_replay import sglang_replay
    steps = [sglang_replay.compact({"decode": s["decode"], "backed": s["backed"],
                                    "requests": [{"slots": slots, "new": n} for slots, n in s["requests"]]}, page)
             for s in steps]
    json.dump({"page_size": page, "num_pages": 16, "steps": steps}, open(path, "w"))


def test_replay_is_bitwise_equal_on_the_cpu(tmp_path, monkeypatch):
    from benchmarks.sglang_replay import sglang_replay

    monkeypatch.delenv("OUT", raising=False)
    path = tmp_path / "trace.json"
    _trace(path)
    result = sglang_replay.replay(str(path), "cpu", layers=2, heads=2, dim=64, q_heads=4, attention_name="torch",
                                  dense_gemms=False)
    assert result["steps"] == 5 and result["bitwise_equal"], result
