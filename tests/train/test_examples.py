"""The math examples end to end through `areal train run` (SFT: no inference service needed).

The GRPO example needs a live inference service with the RL API: tests/train/test_grpo_e2e.py.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import yaml

from areal_train.advantages import group_advantages, normalise_group
from areal_train.metrics import read_metrics
from examples.math import data

ROOT = Path(__file__).resolve().parents[2]
AREAL = Path(sys.executable).with_name("areal")


def areal(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(AREAL), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_sft_through_areal_train_run(tmp_path: Path) -> None:
    res = areal(
        "train",
        "run",
        "--config",
        "examples/math/gsm8k_sft.yaml",
        "--driver",
        "examples.math.gsm8k_sft:main",
        "experiment_name=sft_test",
        "trial_name=t1",
        f"cluster.fileroot={tmp_path}",
        "total_train_steps=8",
        "actor.optimizer.lr=2e-2",
        "+rollout.extra.api_token=Secret0123456789",
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    run = tmp_path / "sft_test" / "t1"
    records = read_metrics(run / "metrics.jsonl")
    before = next(r for r in records if r.get("phase") == "before")
    after = next(r for r in records if r.get("phase") == "after")
    losses = [r["loss"] for r in records if "loss" in r]
    print("SFT loss per step:", [round(x, 3) for x in losses])
    print("eval loss", before["eval_loss"], "->", after["eval_loss"])
    assert len(losses) == 8
    assert after["eval_loss"] < before["eval_loss"] - 1.0
    assert min(losses[-3:]) < losses[0]
    ckpt = Path(after["checkpoint"])
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    saved = run / "config.yaml"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    cfg = yaml.safe_load(saved.read_text())
    assert cfg["total_train_steps"] == 8 and cfg["rollout"]["extra"]["api_token"] == "***"
    assert "Secret0123456789" not in saved.read_text()
    assert "[sft] step 8:" in res.stdout


def test_driver_config_error_is_one_clear_line(tmp_path: Path) -> None:
    res = areal(
        "train",
        "run",
        "--config",
        "examples/math/gsm8k_grpo.yaml",
        "--driver",
        "examples.math.gsm8k_rl:main",
        f"cluster.fileroot={tmp_path}",
        "grpo.grup_size=4",
        timeout=120,
    )
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("areal_train.config.ConfigError: unknown key 'grpo.grup_size'"), last
    assert "did you mean 'grpo.group_size'?" in last
    assert not list(tmp_path.iterdir())  # nothing started, nothing saved


def test_dataset_is_deterministic_and_single_digit() -> None:
    a, b = data.make_dataset(1), data.make_dataset(1)
    assert a == b and len(a) == 55
    assert data.make_dataset(2) != a
    assert all(p.answer <= 9 for p in a)
    assert a[0].prompt.startswith("What is ") and a[0].prompt.endswith("? The answer is")
    assert len(data.make_dataset(1, size=70)) == 70
    batches = data.batches(a, 8, seed=1, epoch=0)
    assert len(batches) == 6 and all(len(b) == 8 for b in batches)
    assert data.batches(a, 8, seed=1, epoch=1) != batches


def test_reward() -> None:
    assert data.reward("7", 7) == 1.0
    assert data.reward(" 7.", 7) == 1.0
    assert data.reward("6", 7) == 0.1 + 0.4 * (1 - 1 / 5)
    assert data.reward("70", 7) == 0.1
    assert data.reward("the", 7) == 0.0
    assert data.reward("", 7) == 0.0


def test_group_advantages() -> None:
    rows = [
        {"group_id": "a", "reward": 1.0},
        {"group_id": "b", "reward": 0.5},
        {"group_id": "a", "reward": 0.0},
        {"group_id": "b", "reward": 0.5},
        {"group_id": "a", "reward": None},
    ]
    adv = group_advantages(rows)
    assert adv[1] == adv[3] == 0.0  # equal rewards: no signal
    assert adv[0] > 0 > adv[2] == adv[4]
    assert abs(sum(adv[i] for i in (0, 2, 4))) < 1e-9
    assert normalise_group([1.0, 0.0], std_normalize=False) == [0.5, -0.5]
    assert normalise_group([1.0, 0.0]) == [1.0 / (0.5 + 1e-6) * 0.5, -1.0 / (0.5 + 1e-6) * 0.5]
