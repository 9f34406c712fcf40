"""python -m vkv.demo, the README's first command: on the host backend it serves the same
queue on a static reservation and on vkv in the same memory, prints the table, and the
attention over the requests both finished is the same on both."""

import re
import subprocess
import sys

import pytest

from vkv import demo


def test_the_demo_fits_more_requests_in_the_same_memory_and_reads_the_same_values(capsys):
    assert demo.main(["--device", "cpu", "--iterations", "60"]) == 0
    out = capsys.readouterr().out
    static = re.search(r"^static reservation +([\d.]+) +(\d+) +(\d+) +(\d+)", out, re.M)
    ours = re.search(r"^vkv +([\d.]+) +(\d+) +(\d+) +(\d+)", out, re.M)
    assert static and ours, out
    assert float(static.group(1)) == demo.STATIC_SLOTS  # a full static reservation: its slots, always
    assert float(ours.group(1)) > 4 * demo.STATIC_SLOTS, out
    assert re.search(r"over the keys and values of the \d+ requests both finished: the same on both caches", out)
    assert "python -m lab.serving" in out


def test_the_queue_is_seeded_and_each_request_fits_half_the_context():
    queue = demo.make_queue(500, seed=3)
    assert [(r.prompt_len, r.output_len) for r in queue] == [(r.prompt_len, r.output_len)
                                                              for r in demo.make_queue(500, seed=3)]
    assert all(4 <= r.prompt_len <= demo.MAX_CONTEXT // 2 and 2 <= r.output_len <= demo.MAX_CONTEXT // 2
               for r in queue)


def test_the_shapes_hold_sixteen_tokens_a_page_on_the_gpu_and_on_the_cpu():
    for shape in (demo.GPU_SHAPE, demo.CPU_SHAPE):
        assert shape.page_size // shape.token_bytes == 16


def test_bad_arguments_are_refused_with_the_value(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--iterations", "0"])
    assert exit_info.value.code == 2
    assert "--iterations = 0 must be at least 1" in capsys.readouterr().err


def test_python_m_vkv_demo_prints_its_help():
    done = subprocess.run([sys.executable, "-m", "vkv.demo", "--help"], capture_output=True, text=True, timeout=120,
                          cwd="/")
    assert done.returncode == 0, done.stderr
    assert "how many requests fit in the same KV memory" in done.stdout
