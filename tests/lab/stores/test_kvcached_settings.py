"""kvcached's knobs as the comparison runs them (lab/stores/kvcached.py): a setting by name or
by its knobs, the environment an engine process of it starts with, and what a bad one says.
No kvcached needed: these are the variables its library reads when it loads."""

import pytest

from lab.stores import kvcached as kvcached_store
from lab.stores.kvcached import KVCACHED_SETTINGS, KvcachedSetting


def test_a_setting_is_named_or_given_by_its_knobs():
    assert KvcachedSetting.parse("default") == KvcachedSetting() and KvcachedSetting().name == "default"
    reserve0 = KvcachedSetting.parse("min=0,max=0")
    assert reserve0 == KVCACHED_SETTINGS["reserve0"] and reserve0.name == "reserve0"
    custom = KvcachedSetting.parse("max=3,prealloc=0,limit=0.4")
    assert (custom.max_reserved_pages, custom.prealloc, custom.limit) == (3, False, 0.4)
    assert custom.name == "max=3,prealloc=0,limit=0.4" and KvcachedSetting.parse(custom.name) == custom
    assert KvcachedSetting.parse("trim=1").trim is True


def test_a_setting_becomes_kvcached_variables_and_only_its_own():
    assert KVCACHED_SETTINGS["reserve1-2"].environment() == {"KVCACHED_MIN_RESERVED_PAGES": "1",
                                                             "KVCACHED_MAX_RESERVED_PAGES": "2"}
    assert KVCACHED_SETTINGS["noprealloc"].environment() == {"KVCACHED_PAGE_PREALLOC_ENABLED": "false"}
    assert KVCACHED_SETTINGS["page4"].environment() == {"KVCACHED_PAGE_SIZE_MB": "4"}
    assert KVCACHED_SETTINGS["limit50"].environment() == {}  # written as kvctl writes it, not read at load


def test_an_engine_of_a_setting_starts_with_its_variables_and_none_of_the_callers(monkeypatch):
    monkeypatch.setenv("KVCACHED_LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
    monkeypatch.setenv("KVCACHED_MAX_RESERVED_PAGES", "7")  # the caller's: not passed on
    env = kvcached_store.kvcached_environment("demo_A", KVCACHED_SETTINGS["reserve0"])
    assert env["KVCACHED_MIN_RESERVED_PAGES"] == "0" and env["KVCACHED_MAX_RESERVED_PAGES"] == "0"
    assert env["KVCACHED_PAGE_PREALLOC_ENABLED"] is None and env["KVCACHED_PAGE_SIZE_MB"] is None  # unset
    default = kvcached_store.kvcached_environment("demo_B")
    assert default["KVCACHED_MAX_RESERVED_PAGES"] is None and default["KVCACHED_IPC_NAME"] == "demo_B"


@pytest.mark.parametrize("text, says", [
    ("fast", "is not one of default"), ("min=-1", "must be at least 0"), ("limit=1.5", "must be in (0, 1]"),
    ("page_mb=3", "positive multiple of 2"), ("max=two", "is not a number"), ("min=", "is not one of")])
def test_a_bad_setting_names_what_is_wrong(text, says):
    with pytest.raises(ValueError, match=f"kvcached setting '{text}'") as error:
        KvcachedSetting.parse(text)
    assert says in str(error.value)
