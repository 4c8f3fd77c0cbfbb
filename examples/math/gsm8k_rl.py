"""GRPO on the arithmetic set: rollouts through an areal inference service.

    areal train run --config examples/math/gsm8k_grpo.yaml \\
        --driver examples.math.gsm8k_rl:main experiment_name=gsm8k_grpo_test trial_name=t1

Per step:
1. for each prompt of the batch, a group of `grpo.group_size` RL sessions
   (`/rl/start_session`); each member chats once through the OpenAI API with its
   session key (temperature > 0), its completion is scored (data.reward) and the
   score is set with `/rl/set_reward`; the group is exported
   (`/rl/export_trajectories`, individual rows, removing the sessions);
2. group-normalised advantages (areal_train.advantages);
3. a PPO-clipped policy-gradient step in the trainer process, against the
   behaviour logprobs the engine recorded in the rows (loss where loss_mask == 1);
4. a checkpoint to <run>/checkpoints/step_<n>, pushed with `/admin/update_weights`;
5. reward mean, weight version and trainer stats per step to stdout and
   <run>/metrics.jsonl.

With `rollout.gateway_url` empty the driver starts its own service
(`areal inf run --detach`, the model at actor.path on rollout.backend) and stops
it at the end; otherwise it uses the given one (admin key from
rollout.admin_api_key or $AREAL_ADMIN_API_KEY).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from areal_client import ArealClient, Group, Trajectory
from areal_train.advantages import group_advantages
from areal_train.config import ConfigError, GRPOConfig, load_expr_config, log_dir
from areal_train.metrics import MetricsLogger
from examples.math import data
from examples.math.common import (
    TaskConfig,
    mean,
    model_path,
    reject_extras,
    save_checkpoint,
    start_trainer,
    total_steps,
)

_AREAL = "import sys; from areal_cli.main import main; sys.exit(main(sys.argv[1:]))"


@dataclass
class MathGRPOConfig(GRPOConfig):
    task: TaskConfig = field(default_factory=TaskConfig)


def areal_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """Run the `areal` CLI (this interpreter's) and return stdout; errors name the command."""
    proc = subprocess.run(
        [sys.executable, "-c", _AREAL, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"`areal {' '.join(args[:3])} ...` failed ({proc.returncode}): {tail}")
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def inference_service(config: MathGRPOConfig) -> Iterator[ArealClient]:
    """Connect to rollout.gateway_url, or start a service for this run and stop it after."""
    ro = config.rollout
    if ro.gateway_url:
        key = ro.admin_api_key or os.environ.get("AREAL_ADMIN_API_KEY", "")
        if not key:
            raise ConfigError(
                "'rollout.admin_api_key' is required with rollout.gateway_url "
                "(or set AREAL_ADMIN_API_KEY)"
            )
        client = ArealClient(ro.gateway_url, key, timeout=ro.request_timeout)
        try:
            yield client
        finally:
            client.close()
        return

    service = ro.service_name or f"areal-{config.experiment_name}-{config.trial_name}"
    service = "".join(c if c.isalnum() or c in "-_" else "-" for c in service)
    key = ro.admin_api_key or "areal-" + secrets.token_urlsafe(24)
    port = _free_port()
    args = [
        "inf",
        "run",
        "--service",
        service,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        ro.model_name,
        "--backend",
        ro.backend,
        "--model-path",
        model_path(config),
        "--model-health-timeout",
        str(ro.setup_timeout),
        "--detach",
    ]
    if ro.engine_args:
        args += ["--engine-args", ro.engine_args]
    # The key travels in the environment, not in argv (visible in `ps`).
    env = {"AREAL_ADMIN_API_KEY": key}
    print(f"[grpo] starting inference service '{service}' on port {port}", flush=True)
    t0 = time.monotonic()
    try:
        areal_cli(*args, env=env, timeout=ro.setup_timeout + 120)
        print(f"[grpo] service ready in {time.monotonic() - t0:.1f}s", flush=True)
        client = ArealClient(f"http://127.0.0.1:{port}", key, timeout=ro.request_timeout)
        try:
            yield client
        finally:
            client.close()
    finally:
        try:
            areal_cli("inf", "stop", "--service", service, timeout=120)
            print(f"[grpo] stopped inference service '{service}'", flush=True)
        except Exception as e:  # already gone, or never started
            print(f"[grpo] stopping service '{service}': {e}", file=sys.stderr, flush=True)


def _rollout(
    client: ArealClient, config: MathGRPOConfig, problem: data.Problem, group: Group, i: int
) -> dict[str, Any]:
    session = group.sessions[i]
    # The SDK on the client's connection pool, bound to this session's key (so it is recorded).
    llm = session.openai(
        http_client=client.http_client, max_retries=0, timeout=config.rollout.request_timeout
    )
    resp = llm.chat.completions.create(
        model=config.rollout.model_name,
        messages=problem.messages(),
        max_tokens=config.grpo.max_new_tokens,
        temperature=config.grpo.temperature,
        top_p=config.grpo.top_p,
    )
    text = resp.choices[0].message.content or ""
    r = data.reward(text, problem.answer)
    client.set_reward(session, r)
    return {"text": text, "reward": r}


def collect(
    client: ArealClient,
    config: MathGRPOConfig,
    batch: list[data.Problem],
    pool: ThreadPoolExecutor,
) -> tuple[list[Trajectory], list[dict[str, Any]]]:
    """Roll out one group per problem; (exported rows, rollout results)."""
    groups = [
        client.start_group(p.task_id, config.grpo.group_size, config.rollout.model_name)
        for p in batch
    ]
    futures = [
        pool.submit(_rollout, client, config, p, g, i)
        for p, g in zip(batch, groups, strict=True)
        for i in range(config.grpo.group_size)
    ]
    results = [f.result() for f in futures]
    rows: list[Trajectory] = []
    for g in groups:
        exported = client.export(
            group_id=g.group_id,
            style=config.grpo.export_style,
            discount=config.grpo.discount,
            remove_session=True,
        )
        if len(exported) < config.grpo.group_size:
            raise RuntimeError(
                f"group {g.group_id} exported {len(exported)} rows for "
                f"{config.grpo.group_size} sessions"
            )
        rows.extend(exported.rows)
    return rows, results


def main(args: list[str]) -> int:
    config, extras = load_expr_config(args, MathGRPOConfig)
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
    metrics = MetricsLogger(run_dir / "metrics.jsonl", prefix="[grpo] ")
    print(f"[grpo] run folder {run_dir}; {len(dataset)} problems, {steps} steps", flush=True)

    g = config.grpo
    with (
        start_trainer(config, steps, ref_model=g.kl_coef > 0) as trainer,
        inference_service(config) as client,
        ThreadPoolExecutor(config.rollout.max_concurrent_rollouts) as pool,
    ):
        step = 0
        version: int | None = None
        for epoch, batches in enumerate(epoch_batches):
            for batch in batches:
                if step >= steps:
                    break
                t0 = time.monotonic()
                rows, results = collect(client, config, batch, pool)
                t_rollout = time.monotonic() - t0
                rows = [r for r in rows if any(r.loss_mask)]
                advantages = group_advantages(
                    [r.to_dict() for r in rows], std_normalize=g.adv_norm_std
                )
                train_rows = [
                    {
                        "input_ids": r.input_ids,
                        "loss_mask": r.loss_mask,
                        "logprobs": r.logprobs,
                        "advantage": a,
                    }
                    for r, a in zip(rows, advantages, strict=True)
                ]
                stats = trainer.call(
                    "ppo_step",
                    rows=train_rows,
                    eps_clip=g.eps_clip,
                    kl_coef=g.kl_coef,
                    temperature=1.0,
                    ppo_epochs=g.ppo_epochs,
                    n_minibatches=g.n_minibatches,
                )
                step += 1
                ckpt = save_checkpoint(trainer, run_dir, f"step_{step}", g.keep_checkpoints)
                version = client.update_weights(str(ckpt)).version
                rollout_versions = sorted({v for r in rows for v in r.output_versions})
                rewards = [r.reward for r in rows]
                metrics.log(
                    step,
                    epoch=epoch,
                    reward_mean=mean(rewards),
                    accuracy=mean([1.0 if x["reward"] == data.CORRECT else 0.0 for x in results]),
                    weight_version=version,
                    rollout_versions=rollout_versions,
                    n_rows=len(rows),
                    loss=stats["loss"],
                    grad_norm=stats["grad_norm"],
                    clip_frac=stats["clip_frac"],
                    ratio_mean=stats["ratio_mean"],
                    entropy=stats["entropy"],
                    lr=stats["lr"],
                    rollout_s=round(t_rollout, 3),
                    step_s=round(time.monotonic() - t0, 3),
                    checkpoint=str(ckpt),
                    sample=results[0]["text"],
                )
    print(
        f"[grpo] done: {step} steps; reward_mean "
        + " ".join(f"{r['reward_mean']:.3f}" for r in metrics.records)
        + f"; weight version {version}",
        flush=True,
    )
    return 0
