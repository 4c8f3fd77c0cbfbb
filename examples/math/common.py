"""Pieces both math drivers share: the task section, the trainer, checkpoints."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_train.config import BaseExperimentConfig, ConfigError, log_dir
from examples.math.trainer_client import TrainerClient, resolve_trainer_python


@dataclass
class TaskConfig:
    """The generated arithmetic dataset (see examples/math/data.py)."""

    max_operand: int = 9
    max_sum: int = 9
    # Problems in the dataset (0 = every (a, b) pair once).
    size: int = 0


def reject_extras(extras: list[str]) -> None:
    if extras:
        raise ConfigError(
            f"unexpected arguments: {' '.join(extras)} (overrides look like key=value)"
        )


def model_path(config: BaseExperimentConfig) -> str:
    path = Path(config.actor.path).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(f"'actor.path' is not a model folder (no config.json): {path}")
    return str(path)


def start_trainer(
    config: BaseExperimentConfig, total_steps: int, *, ref_model: bool = False
) -> TrainerClient:
    run_dir = log_dir(config)
    trainer = TrainerClient.start(
        resolve_trainer_python(config.actor.python), run_dir / "trainer.log"
    )
    try:
        opt = config.actor.optimizer
        info = trainer.call(
            "init",
            model_path=model_path(config),
            seed=config.seed,
            num_threads=config.actor.num_threads,
            dtype=config.actor.dtype,
            optimizer={
                "type": opt.type,
                "lr": opt.lr,
                "weight_decay": opt.weight_decay,
                "beta1": opt.beta1,
                "beta2": opt.beta2,
                "eps": opt.eps,
                "gradient_clipping": opt.gradient_clipping,
                "lr_scheduler_type": opt.lr_scheduler_type,
                "warmup_steps": opt.resolved_warmup_steps(total_steps),
            },
            total_steps=total_steps,
            ref_model=ref_model,
        )
        trainer.info.update(info)
    except BaseException:
        trainer.close()
        raise
    return trainer


def save_checkpoint(trainer: TrainerClient, run_dir: Path, name: str, keep: int) -> Path:
    """Save to <run>/checkpoints/<name>; keep the newest `keep` (0 = all)."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    path = Path(trainer.call("save", path=str(root / name))["path"])
    if keep > 0:
        ckpts = sorted(
            (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime,
        )
        for old in ckpts[:-keep]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return path


def total_steps(config: BaseExperimentConfig, steps_per_epoch: int) -> int:
    steps = steps_per_epoch * config.total_train_epochs
    if config.total_train_steps is not None:
        steps = min(steps, config.total_train_steps)
    return max(1, steps)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def as_float(value: Any) -> float:
    return float(value) if value is not None else 0.0
