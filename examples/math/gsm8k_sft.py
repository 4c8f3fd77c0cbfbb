"""SFT of the tiny model on the arithmetic set, through the trainer process.

    areal train run --config examples/math/gsm8k_sft.yaml \\
        --driver examples.math.gsm8k_sft:main experiment_name=sft trial_name=t1

Each step is one optimizer step of token-mean cross-entropy on the answer
tokens (answer + end token; the prompt is masked). Logs the loss per step and
the loss / greedy accuracy on the whole set before and after; saves a HF
checkpoint to <run>/checkpoints/final. No inference service needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_train.config import SFTConfig, load_expr_config, log_dir
from areal_train.metrics import MetricsLogger
from examples.math import data
from examples.math.common import (
    TaskConfig,
    reject_extras,
    save_checkpoint,
    start_trainer,
    total_steps,
)
from examples.math.trainer_client import TrainerClient


@dataclass
class MathSFTConfig(SFTConfig):
    task: TaskConfig = field(default_factory=TaskConfig)


def greedy_accuracy(
    trainer: TrainerClient, problems: list[data.Problem], prompts: list[list[int]]
) -> float:
    outs = trainer.call("generate", prompts=prompts, max_new_tokens=2, temperature=0.0)["outputs"]
    texts = trainer.call("decode", ids=[o["output_ids"] for o in outs])["texts"]
    hits = [data.reward(t, p.answer) == data.CORRECT for t, p in zip(texts, problems, strict=True)]
    return sum(hits) / len(hits)


def main(args: list[str]) -> int:
    config, extras = load_expr_config(args, MathSFTConfig)
    reject_extras(extras)
    run_dir = log_dir(config)
    dataset = data.make_dataset(
        config.seed, config.task.size, config.task.max_operand, config.task.max_sum
    )
    epoch_batches = [
        data.batches(
            dataset,
            config.train_dataset.batch_size,
            seed=config.seed,
            epoch=e,
            shuffle=config.train_dataset.shuffle,
        )
        for e in range(config.total_train_epochs)
    ]
    steps = total_steps(config, len(epoch_batches[0]))
    metrics = MetricsLogger(run_dir / "metrics.jsonl", prefix="[sft] ")
    print(f"[sft] run folder {run_dir}; {len(dataset)} problems, {steps} steps", flush=True)

    with start_trainer(config, steps) as trainer:
        items: list[dict[str, Any]] = [
            {"messages": p.messages(), "answer": str(p.answer)} for p in dataset
        ]
        rows = trainer.call("encode_chat", items=items)["rows"]
        by_task = {p.task_id: r for p, r in zip(dataset, rows, strict=True)}
        prompts = trainer.call("encode_chat", items=[{"messages": p.messages()} for p in dataset])
        prompt_ids = [r["input_ids"] for r in prompts["rows"]]

        eval_before = trainer.call("eval_loss", rows=rows)["loss"]
        acc_before = greedy_accuracy(trainer, dataset, prompt_ids)
        metrics.log(0, eval_loss=eval_before, greedy_accuracy=acc_before, phase="before")

        step = 0
        for epoch, batches in enumerate(epoch_batches):
            for batch in batches:
                if step >= steps:
                    break
                stats = trainer.call(
                    "sft_step",
                    rows=[by_task[p.task_id] for p in batch],
                    n_minibatches=config.sft.n_minibatches,
                )
                step += 1
                metrics.log(
                    step,
                    epoch=epoch,
                    loss=stats["loss"],
                    grad_norm=stats["grad_norm"],
                    lr=stats["lr"],
                    n_tokens=stats["n_tokens"],
                )
                if config.sft.save_freq_steps and step % config.sft.save_freq_steps == 0:
                    save_checkpoint(trainer, run_dir, f"step_{step}", config.sft.keep_checkpoints)

        eval_after = trainer.call("eval_loss", rows=rows)["loss"]
        acc_after = greedy_accuracy(trainer, dataset, prompt_ids)
        ckpt = save_checkpoint(trainer, run_dir, "final", config.sft.keep_checkpoints)
        metrics.log(
            step,
            eval_loss=eval_after,
            greedy_accuracy=acc_after,
            phase="after",
            checkpoint=str(ckpt),
        )
    print(
        f"[sft] eval loss {eval_before:.4f} -> {eval_after:.4f}, greedy accuracy "
        f"{acc_before:.2f} -> {acc_after:.2f}; checkpoint {ckpt}",
        flush=True,
    )
    return 0
