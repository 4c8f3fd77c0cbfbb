"""areal_train.advantages and areal_train.metrics."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from areal_train.advantages import group_advantages, normalise_group
from areal_train.metrics import MetricsLogger, read_metrics


def test_normalise_group() -> None:
    assert normalise_group([]) == []
    assert normalise_group([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]
    adv = normalise_group([1.0, 0.0, 0.0, 0.0])
    assert adv[0] == pytest.approx(3 / 3**0.5, rel=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert normalise_group([2.0, 0.0], std_normalize=False) == [1.0, -1.0]


def test_group_advantages_by_group_id() -> None:
    rows = [{"group_id": g, "reward": r} for g, r in [("a", 1), ("b", 0), ("a", 0), ("b", 1)]]
    adv = group_advantages(rows)
    assert adv[0] > 0 > adv[2] and adv[3] > 0 > adv[1]
    rows = [{"task": "x", "score": 1.0}, {"task": "x", "score": 3.0}]
    assert group_advantages(rows, group_key="task", reward_key="score", std_normalize=False) == [
        -1.0,
        1.0,
    ]


def test_metrics_logger(tmp_path: Path) -> None:
    out = io.StringIO()
    log = MetricsLogger(tmp_path / "m" / "metrics.jsonl", stream=out, prefix="[x] ")
    log.log(1, reward_mean=0.25, versions=[1, 2])
    log.log(2, reward_mean=0.5)
    records = read_metrics(tmp_path / "m" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["versions"] == [1, 2]
    assert out.getvalue().splitlines() == [
        "[x] step 1: reward_mean=0.25",
        "[x] step 2: reward_mean=0.5",
    ]
