"""The parts of python/vkv/_C.pyi and docs/api.md that scripts/generate_stubs.py writes from
the config fields (include/vkv/config.h) and the stats' fields (include/vkv/stats.h) are
committed as it writes them now, and the dicts stats() and last_step_profile() return hold
exactly the keys those fields declare."""

import importlib.util
import pathlib

import pytest
import torch

import vkv

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_stubs", ROOT / "scripts" / "generate_stubs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = load_generator()


@pytest.mark.parametrize("path", sorted(generator.generated(), key=str), ids=lambda path: path.name)
def test_the_committed_file_is_what_the_generator_writes(path):
    expected = generator.generated()[path]
    assert path.read_text() == expected, (
        f"{path.relative_to(ROOT)} is out of date with include/vkv/config.h: "
        "reinstall vkv and run `python scripts/generate_stubs.py`"
    )


def test_every_field_is_in_the_stub_and_every_parameter_in_the_api_table_with_its_default():
    stub = (ROOT / "python" / "vkv" / "_C.pyi").read_text()
    for name, python_type, default, _ in vkv._C.CacheConfig.fields():
        assert f"        {name}: {python_type} = {default!r}," in stub
    api = (ROOT / "docs" / "api.md").read_text()
    for parameter in vkv._parameters.PARAMETERS:
        default = "required" if parameter.default is vkv._parameters.REQUIRED else f"`{parameter.default!r}`"
        assert f"| `{parameter.name}` | {default} |" in api


def test_the_check_mode_reports_a_stale_file(tmp_path, monkeypatch):
    stale = tmp_path / "_C.pyi"
    stale.write_text(generator.STUB.read_text().replace("num_layers: int = 0,", "num_layers: int = 1,"))
    monkeypatch.setattr(generator, "STUB", stale)
    assert generator.main(["--check"]) == 1
    assert "num_layers: int = 1," in stale.read_text(), "--check changes nothing"
    assert generator.main([]) == 0
    assert stale.read_text() == generator.generated()[stale]


def _check_against_fields(value, struct, groups, where):
    """Every key of `value` (a dict of `struct`) is a declared field of that type, and none is missing."""
    fields = {name: python_type for name, python_type, _ in groups[struct]}
    assert list(value) == list(fields), f"{where}: the keys differ from include/vkv/stats.h's {struct}"
    for name, python_type in fields.items():
        if python_type in groups:
            _check_against_fields(value[name], python_type, groups, f"{where}[{name!r}]")
        else:
            assert type(value[name]).__name__ == python_type, f"{where}[{name!r}] = {value[name]!r} is not {python_type}"


def test_stats_and_the_step_profile_hold_every_declared_field_and_nothing_else():
    groups = vkv._C.stats_fields()
    assert {"CacheStats", "CallStats", "BackendStats", "BudgetHandoff", "StepProfile"} <= set(groups)
    with vkv.KVCache(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_batch_size=2,
                     max_context_len=1024, device="cpu") as cache:
        slot = cache.alloc_reqid()
        cache.step({slot: 10})
        stats, profile = cache.stats(), cache.last_step_profile()
    _check_against_fields(stats, "CacheStats", groups, "stats()")
    _check_against_fields(profile, "StepProfile", groups, "last_step_profile()")
    assert stats["step"]["calls"] == 1 and stats["pages_in_use"] >= 1
    assert stats["backend"]["cleanup_failures"] == 0


def test_the_stub_types_stats_with_the_declared_typed_dicts():
    stub = (ROOT / "python" / "vkv" / "_C.pyi").read_text()
    assert "    def stats(self) -> CacheStats: ..." in stub
    assert "    def last_step_profile(self) -> StepProfile: ..." in stub
    for struct, fields in vkv._C.stats_fields().items():
        assert f"class {struct}(TypedDict):" in stub
        for name, python_type, _ in fields:
            assert f"    {name}: {python_type}  # " in stub
