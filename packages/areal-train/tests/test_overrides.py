"""The override grammar is hydra's parser (areal_train/overrides.py); where hydra's grammar is
narrower than the argv drivers took before, the old reading holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_train.config import ConfigError, GRPOConfig, load_expr_config, split_argv
from areal_train.overrides import Parsed, parse, value

BASE = ["experiment_name=e", "trial_name=t", "actor.path=m"]


def load(*args: str) -> tuple[GRPOConfig, list[str]]:
    cfg, extras = load_expr_config([*BASE, *args], GRPOConfig, save=False)
    assert isinstance(cfg, GRPOConfig)
    return cfg, extras


def test_parse_splits_prefix_key_and_raw_text() -> None:
    assert parse("a.b=1") == Parsed("", "a.b", "1")
    assert parse("+a.items.0=x") == Parsed("+", "a.items.0", "x")
    assert parse("++a-b.c= spaced ") == Parsed("++", "a-b.c", " spaced ")
    assert parse("~a.b") == Parsed("~", "a.b", None)
    assert parse("~a.b=1") == Parsed("~", "a.b", "1")


@pytest.mark.parametrize("arg", ["word", "a.b", "9a=1", "group/option=x", "key@pkg=1", "=1"])
def test_not_an_override(arg: str) -> None:
    assert parse(arg) is None


def test_values_are_hydras() -> None:
    assert value("null", keep_text=False) is None
    assert value("True", keep_text=False) is True
    assert value("1_000", keep_text=False) == 1000
    assert value("5e-6", keep_text=False) == 5e-6
    assert value("[1, 'a b', {k: v}]", keep_text=False) == [1, "a b", {"k": "v"}]
    assert value("'it\\'s'", keep_text=False) == "it's"
    assert value("${seed}", keep_text=False) == "${seed}"


def test_a_str_field_keeps_its_text_but_reads_null_and_quotes() -> None:
    assert value("001", keep_text=True) == "001"
    assert value(" a b ", keep_text=True) == " a b "
    assert value("null", keep_text=True) is None
    assert value("'001'", keep_text=True) == "001"


def test_what_hydra_refuses_stays_text(tmp_path: Path) -> None:
    # An unquoted "=" or "?" (a URL with a query) and a sweep were text before hydra read them.
    assert value("http://h:1/p?q=1", keep_text=False) == "http://h:1/p?q=1"
    assert value("1,2", keep_text=False) == "1,2"
    cfg, extras = load("+extra.url=http://h:1/p?q=1", "+extra.pair=1,2", "group/opt=x")
    assert cfg.extra == {"url": "http://h:1/p?q=1", "pair": "1,2"}
    assert extras == ["group/opt=x"]


def test_a_broken_list_or_map_names_the_value() -> None:
    with pytest.raises(ConfigError, match=r"cannot parse value '\[1, 2': "):
        load("+extra.items=[1, 2")
    with pytest.raises(ConfigError, match=r"cannot parse value '\{a: 1': "):
        load("+extra.m={a: 1")


def test_split_argv_uses_the_same_grammar() -> None:
    assert split_argv(["a.b=1", "~c", "+d.0=[", "word", "x/y=1", "-v"]) == (
        None,
        ["a.b=1", "~c", "+d.0=["],
        ["word", "x/y=1", "-v"],
    )
