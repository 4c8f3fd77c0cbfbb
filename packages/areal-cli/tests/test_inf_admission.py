"""Admission bounds at `areal inf run --model` / `register`: flags over [register.internal],
checked before anything starts; what `status` prints of them."""

from __future__ import annotations

import pytest

from areal_cli import admission, config
from areal_cli.errors import CLIError


def _cfg(home, tmp_path, text: str) -> config.Config:
    path = tmp_path / "inf.toml"
    path.write_text(text)
    return config.load("inf", path)


def test_flags_win_over_the_toml_and_unset_means_no_bound(home, tmp_path):
    cfg = _cfg(
        home,
        tmp_path,
        "[register.internal]\nmax_staleness = 2\nbatch_size = 8\nmax_concurrent_rollouts = 64\n",
    )
    assert admission.resolve(cfg, {}) == {
        "max_staleness": 2,
        "batch_size": 8,
        "max_concurrent_rollouts": 64,
    }
    got = admission.resolve(cfg, {"max_staleness": 0, "max_concurrent_rollouts": 4})
    assert got == {"max_staleness": 0, "batch_size": 8, "max_concurrent_rollouts": 4}
    assert admission.resolve(config.load("inf"), {}) == {}


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        ({"max_staleness": -1, "batch_size": 1}, "--max-staleness must be an integer >= 0"),
        ({"max_staleness": 1, "batch_size": 0}, "--batch-size must be an integer >= 1"),
        ({"max_concurrent_rollouts": 0}, "--max-concurrent-rollouts must be"),
        ({"max_staleness": 1}, "--max-staleness and --batch-size go together"),
    ],
)
def test_bad_bounds_are_usage_errors(home, given, needle):
    with pytest.raises(CLIError) as exc:
        admission.resolve(config.load("inf"), given)
    assert needle in str(exc.value) and exc.value.code == 2


def test_a_toml_bound_of_the_wrong_type_names_its_key(home, tmp_path):
    with pytest.raises(CLIError, match="max_staleness"):
        _cfg(home, tmp_path, '[register.internal]\nmax_staleness = "2"\n')


def test_status_row():
    st = {
        "model": "m",
        "max_staleness": 1,
        "batch_size": 4,
        "max_concurrent_rollouts": None,
        "version": 3,
        "running": 2,
        "ended": 1,
        "consumed": 9,
        "capacity_left": 8,
        "limited_by": "staleness",
        "waiting": 0,
    }
    row = admission.describe(st)
    assert row == ["m", "3", "2", "1", "9", "0", "8 (staleness)", "max_staleness=1, batch_size=4"]
    assert len(row) == len(admission.HEADERS)
    st.update(max_staleness=None, batch_size=None, capacity_left=None, limited_by=None)
    assert admission.describe(st)[-2:] == ["unbounded", "none"]
