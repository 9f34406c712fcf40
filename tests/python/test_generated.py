"""The parts of python/vkv/_C.pyi and docs/api.md that scripts/generate_stubs.py writes from
the config fields (include/vkv/config.h) are committed as it writes them now."""

import importlib.util
import pathlib

import pytest

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
