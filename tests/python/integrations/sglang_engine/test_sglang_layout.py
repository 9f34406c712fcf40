"""Where vkv puts SGLang's pool buffers (vkv.integrations.sglang.layout) and the plugin's
settings: no SGLang needed."""

import re
from pathlib import Path

import pytest

from vkv.integrations.sglang.layout import mha_layout, mla_layout
from vkv.integrations.sglang.settings import Settings

MIB = 1 << 20


def test_mha_buffers_keep_sglang_shapes_on_their_own_pages():
    layout = mha_layout(size=1000 * 16, page_size=16, layers=3, heads=8, head_dim=128, v_head_dim=128, itemsize=2,
                        vkv_page_bytes=2 * MIB)
    assert len(layout.buffers) == 6 and layout.num_blocks == 1001
    for buffer in layout.buffers:
        assert buffer.shape == (1000 * 16 + 16, 8, 128)
        assert buffer.offset % (2 * MIB) == 0
    k, v = layout.buffers[0], layout.buffers[1]
    assert (v.offset - k.offset) % (16 * k.row_bytes) == 0  # V a whole number of K blocks after K
    assert layout.ranges()[0] == (0, 16 * 2048, 16 * 2048)
    assert layout.token_bytes() == 3 * 2 * 2048
    assert layout.reserved_bytes >= layout.buffers[-1].offset + layout.buffers[-1].nbytes


def test_mha_with_its_own_v_head_size():
    layout = mha_layout(size=64, page_size=16, layers=1, heads=2, head_dim=192, v_head_dim=128, itemsize=2,
                        vkv_page_bytes=4096)
    assert [b.shape for b in layout.buffers] == [(80, 2, 192), (80, 2, 128)]
    assert [length for _, length, _ in layout.ranges()] == [16 * 768, 16 * 512]


def test_a_floor_is_held_in_whole_steps_of_a_page_in_every_buffer():
    layout = mha_layout(size=512, page_size=16, layers=2, heads=2, head_dim=16, v_head_dim=16, itemsize=4,
                        vkv_page_bytes=4096)
    step = 4 * 4096  # 2 layers' K and V
    assert [layout.held_floor(floor, 4096) for floor in (0, 1, step, 5 * step // 2)] == [0, step, step, 3 * step]
    fused = mla_layout(size=160, page_size=32, layers=3, kv_cache_dim=576, itemsize=2, vkv_page_bytes=2 * MIB)
    assert fused.held_floor(8 * MIB, 2 * MIB) == 12 * MIB  # one buffer a layer


def test_mla_one_latent_buffer_a_layer():
    layout = mla_layout(size=160, page_size=32, layers=2, kv_cache_dim=576, itemsize=2, vkv_page_bytes=2 * MIB)
    assert [b.shape for b in layout.buffers] == [(192, 1, 576)] * 2
    assert layout.num_blocks == 6 and layout.ranges()[1] == (2 * MIB, 32 * 1152, 32 * 1152)


def test_settings_are_off_without_a_budget_and_parse_sizes():
    assert Settings.from_environment({}) is None
    assert Settings.from_environment({"VKV_SGLANG_BUDGET": "  "}) is None
    settings = Settings.from_environment({"VKV_SGLANG_BUDGET": "gpu0", "VKV_SGLANG_FLOOR": "8GiB",
                                          "VKV_SGLANG_CAP": "30GiB", "VKV_SGLANG_PRIORITY": "2",
                                          "VKV_SGLANG_LABEL": "chat"})
    assert (settings.budget, settings.floor, settings.cap, settings.priority) == ("gpu0", 8 << 30, 30 << 30, 2)
    assert settings.member_label(1, 2) == "chat-tp1" and settings.member_label(0, 1) == "chat"


@pytest.mark.parametrize("name, value, words", [("VKV_SGLANG_FLOOR", "lots", "VKV_SGLANG_FLOOR='lots'"),
                                                ("VKV_SGLANG_PRIORITY", "-1", "VKV_SGLANG_PRIORITY='-1'"),
                                                ("VKV_SGLANG_BUDGT", "x", "VKV_SGLANG_BUDGT is not a vkv setting")])
def test_bad_settings_are_refused_in_one_line(name, value, words):
    with pytest.raises(ValueError) as error:
        Settings.from_environment({"VKV_SGLANG_BUDGET": "gpu0", name: value})
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_projects_own_scripts_set_no_variable_the_plugin_would_refuse():
    # SGLang inherits its launcher's environment: a VKV_SGLANG_* name a script or CI exports
    # for itself would stop every engine the tests start.
    root = Path(__file__).resolve().parents[4]
    texts = [path.read_text() for path in [root / ".ci" / "run", *(root / "scripts").rglob("*.sh")] if path.exists()]
    names = {name for text in texts for name in re.findall(r"\bVKV_SGLANG_[A-Z_]+", text)}
    known = {"VKV_SGLANG_" + key for key in ("BUDGET", "FLOOR", "CAP", "PRIORITY", "LABEL", "HEADROOM")}
    assert names <= known, sorted(names - known)
