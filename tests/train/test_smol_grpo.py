"""The SmolLM2 GRPO example, 2 steps: a real service on the real model, weights pushed each step.

What the long run (examples/math/README.md) measures, in miniature: rollouts in groups with
session keys, the exact-answer reward, exported trajectories, a policy-gradient step, new
weights through /admin/update_weights, the next step's tokens carrying the pushed version,
the held-out set evaluated before and after, curve.csv written. Needs the model
(scripts/setup-model.sh); skipped without it unless AREAL_TEST_REQUIRE_REAL_MODEL=1.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
AREAL = Path(sys.executable).with_name("areal")
STEPS = 2


@pytest.mark.timeout(1500)
def test_smol_grpo_two_steps(tmp_path: Path, model_ready: None) -> None:
    env = {**os.environ, "AREAL_HOME": str(tmp_path / "areal-home")}
    res = subprocess.run(
        [
            str(AREAL),
            "train",
            "run",
            "--config",
            "examples/math/smol_grpo.yaml",
            "--driver",
            "examples.math.smol_rl:main",
            "experiment_name=smol_grpo_test",
            "trial_name=t1",
            f"cluster.fileroot={tmp_path / 'runs'}",
            f"total_train_steps={STEPS}",
            "train_dataset.batch_size=2",
            "grpo.group_size=4",
            "task.n_eval=8",
            "eval.every=0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "smol_grpo_test" / "t1"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["n_rows"] == 8
        assert 0.0 <= r["reward_mean"] <= 1.0
        assert Path(r["checkpoint"]).name == f"step_{r['step']}"
    versions = [r["weight_version"] for r in records]
    assert versions == [1, 2]  # every step pushed its weights ...
    assert records[0]["rollout_versions"] == [0]
    for prev, cur in itertools.pairwise(records):  # ... and the next step sampled from them
        assert cur["rollout_versions"] == [prev["weight_version"]]
    evals = read_metrics(run / "eval.jsonl")
    assert [(e["step"], e["weight_version"], e["n"]) for e in evals] == [(0, 0, 8), (2, 2, 8)]
    assert all(0.0 <= e["strict_accuracy"] <= e["accuracy"] <= 1.0 for e in evals)
    assert any(s["text"].strip() for e in evals for s in e["samples"])  # real answers
    curve = list(csv.DictReader((run / "curve.csv").open()))
    assert [c["step"] for c in curve] == ["0", "1", "2"]
    assert curve[0]["eval_accuracy"] != "" and curve[-1]["eval_accuracy"] != ""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["weight_version"] == 2
    assert "stopped inference service" in out
    assert "restarting" not in (out + _watchdog_log(tmp_path)), "the engine was restarted"


def _watchdog_log(tmp_path: Path) -> str:
    logs = sorted((tmp_path / "areal-home").rglob("watchdog.log"))
    return "".join(p.read_text(errors="replace") for p in logs)
