"""The asynchronous SmolLM2 GRPO example, 2 steps: rollouts under the service's admission while
the trainer trains, a decoupled PPO step, weights pushed each step.

In miniature what examples/math/README.md measures of it: groups started only once admitted
(η = 1: the service's bounds are set by the driver), exported with the staleness bound and
a group policy, the staleness of what was trained within η, the decoupled objective's
behaviour weights reported, the held-out set evaluated before and after. Needs the model
(scripts/setup-model.sh); skipped without it unless AREAL_TEST_REQUIRE_REAL_MODEL=1.
"""

from __future__ import annotations

import csv
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
ETA = 1


@pytest.mark.timeout(900)
def test_smol_async_two_steps(tmp_path: Path, model_ready: None) -> None:
    env = {**os.environ, "AREAL_HOME": str(tmp_path / "areal-home")}
    res = subprocess.run(
        [
            str(AREAL),
            "train",
            "run",
            "--config",
            "examples/math/smol_async.yaml",
            "--driver",
            "examples.math.smol_async_rl:main",
            "experiment_name=smol_async_test",
            "trial_name=t1",
            f"cluster.fileroot={tmp_path / 'runs'}",
            f"total_train_steps={STEPS}",
            "train_dataset.batch_size=2",
            "grpo.group_size=4",
            "task.n_eval=8",
            "eval.every=0",
            f"async_rl.max_staleness={ETA}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=850,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    run = tmp_path / "runs" / "smol_async_test" / "t1"
    # The driver set the model's admission bounds: η, and a step's samples as the batch.
    admission = json.loads(out.split("[smol-async] admission ", 1)[1].splitlines()[0])
    assert (admission["max_staleness"], admission["batch_size"]) == (ETA, 2 * 4)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["weight_version"] for r in records] == [1, 2]
    for r in records:
        assert 2 <= r["n_rows"] <= 8  # two groups, each with at least 2 usable members
        assert 0.0 <= r["reward_mean"] <= 1.0
        # Trained within the bound: the staleness against the trainer's version is <= η.
        assert r["staleness"] and all(0 <= int(k) <= ETA for k in r["staleness"])
        assert r["behav_weight_mean"] > 0 and 0.0 <= r["engine_busy"] <= 1.0
        assert max(r["rollout_versions"]) <= r["weight_version"] - 1
    assert records[0]["rollout_versions"] == [0]
    evals = read_metrics(run / "eval.jsonl")
    assert [(e["step"], e["n"]) for e in evals] == [(0, 8), (2, 8)]
    curve = list(csv.DictReader((run / "curve.csv").open()))
    assert [c["step"] for c in curve] == ["0", "1", "2"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["max_staleness"] == ETA
    assert 0.0 <= summary["trainer_idle"] <= 1.0 and 0.0 <= summary["engine_idle"] <= 1.0
    assert summary["samples_per_minute"] > 0
    assert "stopped inference service" in out
