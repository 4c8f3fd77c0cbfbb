"""GRPO of SmolLM2-135M-Instruct on small arithmetic, rolled out through an areal service.

    areal train run --config examples/math/smol_grpo.yaml \\
        --driver examples.math.smol_rl:main experiment_name=smol_grpo trial_name=t1

The model is `actor.path` (a folder, or `smollm2`: the one scripts/setup-model.sh set up).
The task (examples/math/arith.py) is generated: a training set and a disjoint held-out set
of "What is a + b? Answer with a number." with their answers. Per step:

1. for each prompt of the batch, a group of `grpo.group_size` RL sessions
   (`/rl/start_session`); each member chats once with its session key (temperature > 0);
   the completion gets the exact-answer reward (`/rl/set_reward`); the group is exported
   (`/rl/export_trajectories`, removing the sessions);
2. group-normalised advantages; a PPO-clipped policy-gradient step in the trainer process
   (examples/math/trainer.py) against the engine's behaviour logprobs;
3. the new weights saved and pushed with `/admin/update_weights` (every step), so the next
   step's exported tokens carry the new weight version (checked: a mismatch is an error);
4. reward, accuracy and versions to <run>/metrics.jsonl and <run>/curve.csv.

The held-out set is answered greedily through the same service before the first step, every
`eval.every` steps and after the last: accuracy (exact answer; and the number alone) to <run>/eval.jsonl and
the curve. `eval.max_minutes` > 0 stops training (then evaluates) once that much time has
passed. examples/math/plot_curve.py draws curve.csv as a PNG.
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_client import ArealClient, Group, Trajectory
from areal_train.advantages import group_advantages
from areal_train.config import ConfigError, GRPOConfig, load_expr_config, log_dir
from areal_train.metrics import MetricsLogger
from examples.math import arith
from examples.math.common import mean, reject_extras, save_checkpoint, start_trainer
from examples.math.gsm8k_rl import areal_cli, inference_service

CURVE_FIELDS = (
    "step",
    "weight_version",
    "reward_mean",
    "train_accuracy",
    "eval_accuracy",
    "eval_strict_accuracy",
    "elapsed_s",
)


@dataclass
class ArithTaskConfig:
    """The generated problems (examples/math/arith.py)."""

    ops: str = "+"
    min_operand: int = 10
    max_operand: int = 99
    n_train: int = 0  # 0 = every problem not held out
    n_eval: int = 64
    system: str = ""  # a system message before each question ("" = the model's default)
    instruction: str = "Answer with a number."  # appended to each question


@dataclass
class EvalConfig:
    every: int = 0  # also evaluate every N steps (0 = before and after only)
    max_new_tokens: int = 16
    concurrency: int = 16
    max_minutes: float = 0.0  # stop training after this long (0 = no limit)


@dataclass
class SmolGRPOConfig(GRPOConfig):
    task: ArithTaskConfig = field(default_factory=ArithTaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def resolve_actor_path(config: SmolGRPOConfig) -> None:
    """A short name (`smollm2`) becomes the cached folder scripts/setup-model.sh wrote."""
    from areal_cli.errors import CLIError
    from areal_cli.models import resolve_short_name

    try:
        folder = resolve_short_name(config.actor.path)
    except CLIError as e:
        raise ConfigError(f"'actor.path': {e}") from None
    if folder:
        config.actor.path = folder


# The engine answers /health late while a big prefill runs on a busy CPU (SGLang reports
# unhealthy after 20 s without a scheduler heartbeat; measured on a shared 2-core machine):
# with the default (12 missed checks) the watchdog restarted a healthy engine mid-rollout.
SUPERVISION_TOML = """[supervision]
# an engine counts as hung after 4 x hung_after missed checks (areal_cli.watchdog)
hung_after = 60
"""


@contextmanager
def service(config: SmolGRPOConfig, run_dir: Path) -> Iterator[ArealClient]:
    """rollout.gateway_url's service, or one started for this run (as gsm8k_rl does, with a
    supervision policy that tolerates a slow engine health check) and stopped after."""
    ro = config.rollout
    if ro.gateway_url:
        with inference_service(config) as client:  # type: ignore[arg-type]
            yield client
        return
    name = ro.service_name or f"areal-{config.experiment_name}-{config.trial_name}"
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    toml = run_dir / "inf-config.toml"
    toml.write_text(SUPERVISION_TOML)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    args = [
        "inf",
        "--config",
        str(toml),
        "run",
        "--service",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        ro.model_name,
        "--backend",
        ro.backend,
        "--model-path",
        config.actor.path,
        "--model-health-timeout",
        str(ro.setup_timeout),
        "--detach",
    ]
    if ro.engine_args:
        args += ["--engine-args", ro.engine_args]
    print(f"[smol-grpo] starting inference service '{name}' on port {port}", flush=True)
    t0 = time.monotonic()
    try:
        # The key travels in the environment, not in argv (visible in `ps`).
        areal_cli(
            *args, env={"AREAL_ADMIN_API_KEY": ro.admin_api_key}, timeout=ro.setup_timeout + 120
        )
        print(f"[smol-grpo] service ready in {time.monotonic() - t0:.1f}s", flush=True)
        with ArealClient(
            f"http://127.0.0.1:{port}", ro.admin_api_key, timeout=ro.request_timeout
        ) as c:
            yield c
    finally:
        try:
            areal_cli("inf", "stop", "--service", name, timeout=180)
            print(f"[smol-grpo] stopped inference service '{name}'", flush=True)
        except Exception as e:  # already gone, or never started
            print(f"[smol-grpo] stopping service '{name}': {e}", file=sys.stderr, flush=True)


def _sdk(base_url: str, key: str, client: ArealClient, timeout: float) -> Any:
    import openai

    return openai.OpenAI(
        base_url=base_url + "/v1",
        api_key=key,
        http_client=client.http_client,
        max_retries=0,
        timeout=timeout,
    )


def evaluate(
    client: ArealClient, key: str, config: SmolGRPOConfig, problems: list[arith.Problem]
) -> dict[str, Any]:
    """Greedy answers to the held-out problems through the service (not recorded)."""
    llm = _sdk(client.base_url, key, client, config.rollout.request_timeout)

    def answer(p: arith.Problem) -> str:
        r = llm.chat.completions.create(
            model=config.rollout.model_name,
            messages=p.messages(),
            max_tokens=config.eval.max_new_tokens,
            temperature=0,
        )
        return r.choices[0].message.content or ""

    t0 = time.monotonic()
    with ThreadPoolExecutor(max(1, config.eval.concurrency)) as pool:
        texts = list(pool.map(answer, problems))
    exact = [arith.reward(t, p.answer) for t, p in zip(texts, problems, strict=True)]
    strict = [arith.strict_correct(t, p.answer) for t, p in zip(texts, problems, strict=True)]
    return {
        "accuracy": mean(exact),
        "strict_accuracy": mean([float(x) for x in strict]),
        "n": len(problems),
        "seconds": round(time.monotonic() - t0, 1),
        "samples": [
            {"q": p.question, "answer": p.answer, "text": t}
            for p, t in list(zip(problems, texts, strict=True))[:4]
        ],
    }


def _rollout(
    client: ArealClient, config: SmolGRPOConfig, problem: arith.Problem, group: Group, i: int
) -> dict[str, Any]:
    session = group.sessions[i]
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
    r = arith.reward(text, problem.answer)
    client.set_reward(session, r)
    return {"text": text, "reward": r}


def collect(
    client: ArealClient,
    config: SmolGRPOConfig,
    batch: list[arith.Problem],
    pool: ThreadPoolExecutor,
) -> tuple[list[Trajectory], list[dict[str, Any]]]:
    """One group per problem, rolled out concurrently; (exported rows, rollout results)."""
    g = config.grpo
    groups = [client.start_group(p.task_id, g.group_size, config.rollout.model_name) for p in batch]
    futures = [
        pool.submit(_rollout, client, config, p, grp, i)
        for p, grp in zip(batch, groups, strict=True)
        for i in range(g.group_size)
    ]
    results = [f.result() for f in futures]
    rows: list[Trajectory] = []
    for grp in groups:
        exported = client.export(
            group_id=grp.group_id, style=g.export_style, discount=g.discount, remove_session=True
        )
        if len(exported) != g.group_size:
            raise RuntimeError(
                f"group {grp.group_id} exported {len(exported)} rows for {g.group_size} sessions"
            )
        rows.extend(exported.rows)
    return rows, results


def batches(problems: list[arith.Problem], size: int, seed: int, steps: int) -> list[list[Any]]:
    """`steps` batches, walking shuffled epochs of the training set."""
    import random

    out: list[list[arith.Problem]] = []
    epoch = 0
    while len(out) < steps:
        order = list(problems)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out += [order[i : i + size] for i in range(0, len(order) - size + 1, size)]
        epoch += 1
    return out[:steps]


class Curve:
    """<run>/curve.csv: one row per step (and step 0, before training), rewritten each time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def add(self, **row: Any) -> None:
        self.rows.append({k: row.get(k, "") for k in CURVE_FIELDS})
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CURVE_FIELDS)
            w.writeheader()
            w.writerows(self.rows)
        os.replace(tmp, self.path)


def task_split(config: SmolGRPOConfig) -> tuple[list[arith.Problem], list[arith.Problem]]:
    """The config's training and held-out problems (the synchronous and asynchronous examples
    share it, so the same seed gives both the same task)."""
    t = config.task
    try:
        return arith.make_split(
            config.seed,
            ops=t.ops,
            min_operand=t.min_operand,
            max_operand=t.max_operand,
            n_train=t.n_train,
            n_eval=t.n_eval,
            system=t.system,
            instruction=t.instruction,
        )
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None


def main(args: list[str]) -> int:
    config, extras = load_expr_config(args, SmolGRPOConfig)
    reject_extras(extras)
    resolve_actor_path(config)
    train, held_out = task_split(config)
    g = config.grpo
    if g.group_size < 2:
        raise ConfigError("'grpo.group_size' must be at least 2 (advantages are within a group)")
    steps = config.total_train_steps or (
        config.total_train_epochs * (len(train) // config.train_dataset.batch_size)
    )
    plan = batches(train, config.train_dataset.batch_size, config.seed, steps)
    run_dir = log_dir(config)
    metrics = MetricsLogger(run_dir / "metrics.jsonl", prefix="[smol-grpo] ")
    evals = MetricsLogger(run_dir / "eval.jsonl", prefix="[smol-grpo] eval ")
    curve = Curve(run_dir / "curve.csv")
    print(
        f"[smol-grpo] run folder {run_dir}; model {config.actor.path}; {len(train)} training "
        f"problems, {len(held_out)} held out; {steps} steps of {len(plan[0])} x {g.group_size}",
        flush=True,
    )
    # The admin key is chosen here (not inside inference_service) so evaluation can use it.
    ro = config.rollout
    key = ro.admin_api_key or os.environ.get("AREAL_ADMIN_API_KEY", "")
    if not key and not ro.gateway_url:
        key = "areal-" + secrets.token_urlsafe(24)
    ro.admin_api_key = key

    t_start = time.monotonic()
    with (
        start_trainer(config, steps, ref_model=g.kl_coef > 0) as trainer,
        service(config, run_dir) as client,
        ThreadPoolExecutor(ro.max_concurrent_rollouts) as pool,
    ):

        def run_eval(step: int, version: int) -> dict[str, Any]:
            ev = evaluate(client, key, config, held_out)
            evals.log(step, weight_version=version, **ev)
            return ev

        version = 0
        ev = run_eval(0, version)
        curve.add(
            step=0,
            weight_version=version,
            eval_accuracy=ev["accuracy"],
            eval_strict_accuracy=ev["strict_accuracy"],
            elapsed_s=round(time.monotonic() - t_start),
        )
        step = 0
        for batch in plan:
            if (
                config.eval.max_minutes
                and time.monotonic() - t_start > 60 * config.eval.max_minutes
            ):
                print(f"[smol-grpo] time limit reached after {step} steps", flush=True)
                break
            t0 = time.monotonic()
            rows, results = collect(client, config, batch, pool)
            t_rollout = time.monotonic() - t0
            rollout_versions = sorted({v for r in rows for v in r.output_versions})
            if rollout_versions != [version]:
                raise RuntimeError(
                    f"step {step + 1}: tokens of versions {rollout_versions}, expected [{version}]"
                )
            rows = [r for r in rows if any(r.loss_mask)]
            advantages = group_advantages([r.to_dict() for r in rows], std_normalize=g.adv_norm_std)
            stats = trainer.call(
                "ppo_step",
                rows=[
                    {
                        "input_ids": r.input_ids,
                        "loss_mask": r.loss_mask,
                        "logprobs": r.logprobs,
                        "advantage": a,
                    }
                    for r, a in zip(rows, advantages, strict=True)
                ],
                eps_clip=g.eps_clip,
                kl_coef=g.kl_coef,
                temperature=1.0,
                ppo_epochs=g.ppo_epochs,
                n_minibatches=g.n_minibatches,
            )
            t_train = time.monotonic() - t0 - t_rollout
            step += 1
            ckpt = save_checkpoint(trainer, run_dir, f"step_{step}", g.keep_checkpoints)
            version = client.update_weights(str(ckpt)).version
            reward_mean = mean([r.reward for r in rows])
            metrics.log(
                step,
                weight_version=version,
                rollout_versions=rollout_versions,
                reward_mean=reward_mean,
                train_accuracy=mean([x["reward"] for x in results]),
                n_rows=len(rows),
                loss=stats["loss"],
                grad_norm=stats["grad_norm"],
                clip_frac=stats["clip_frac"],
                entropy=stats["entropy"],
                lr=stats["lr"],
                rollout_s=round(t_rollout, 1),
                train_s=round(t_train, 1),
                step_s=round(time.monotonic() - t0, 1),
                checkpoint=str(ckpt),
                sample=results[0]["text"],
            )
            row: dict[str, Any] = {
                "step": step,
                "weight_version": version,
                "reward_mean": round(reward_mean, 4),
                "train_accuracy": round(mean([x["reward"] for x in results]), 4),
            }
            last = step == len(plan)
            if (config.eval.every and step % config.eval.every == 0) or last:
                ev = run_eval(step, version)
                row.update(eval_accuracy=ev["accuracy"], eval_strict_accuracy=ev["strict_accuracy"])
            curve.add(**row, elapsed_s=round(time.monotonic() - t_start))
        if curve.rows[-1]["eval_accuracy"] == "":
            ev = run_eval(step, version)
            curve.rows[-1].update(
                eval_accuracy=ev["accuracy"], eval_strict_accuracy=ev["strict_accuracy"]
            )
            curve.add(**curve.rows.pop())
    first, final = evals.records[0], evals.records[-1]
    summary = {
        "steps": step,
        "weight_version": version,
        "eval_accuracy_before": first["accuracy"],
        "eval_accuracy_after": final["accuracy"],
        "eval_strict_before": first["strict_accuracy"],
        "eval_strict_after": final["strict_accuracy"],
        "minutes": round((time.monotonic() - t_start) / 60, 1),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[smol-grpo] done: {json.dumps(summary)}", flush=True)
    return 0
