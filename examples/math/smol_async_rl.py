"""Asynchronous GRPO of SmolLM2-135M-Instruct on small arithmetic: rollouts never wait for the
trainer, the service bounds how stale what it trains on may be.

    areal train run --config examples/math/smol_async.yaml \\
        --driver examples.math.smol_async_rl:main experiment_name=smol_async trial_name=t1

The task, model, service and evaluation are the synchronous example's (examples/math/smol_rl.py);
what differs is the loop:

- Rollout workers (`async_rl.rollout_workers` threads) run all the time, one group at a time
  each: a group starts only once the service's admission admits it
  (`start_group_when_admitted`; the model's bounds are set here through
  `PUT /admin/models/{name}/admission`: `max_staleness` = η = `async_rl.max_staleness`,
  `batch_size` = the samples one step trains, `max_concurrent_rollouts`). Its members chat
  once each, get the exact-answer reward; a member whose chat failed is ended with why
  (`failure`). The group is exported at once with `max_staleness` = η and
  `min_usable_group_size` (a group with too few usable members is dropped, the rest of a group
  is kept) and handed to the trainer through a queue.
- The trainer takes `train_dataset.batch_size` groups from the queue (waiting only when there
  are none), and makes a decoupled PPO step (examples/math/trainer.py, `decoupled`): the
  behaviour logprobs are the recorded ones, the proximal policy is recomputed by the trainer
  before the update, the behaviour importance weights are clipped at
  `async_rl.behav_imp_weight_cap`. New weights are pushed every step
  (`/admin/update_weights`): a generation running across it keeps its older tokens with their
  version, and goes on with the new weights.

With η = 0 the service admits the next step's groups only once the current weights are pushed,
so rollouts and training take turns as in the synchronous example (apart from exporting and
queueing); η = 1, 2 let rollouts run one or two versions ahead of the trainer.

Written to the run folder: metrics.jsonl (per step: the staleness of what was trained, the
trainer's wait, the engine's busy fraction, the export summaries' drops), eval.jsonl,
curve.csv, summary.json, as the synchronous example does.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from areal_client import ArealClient, ExportSelection, RateLimitError, Trajectory
from areal_train.advantages import group_advantages
from areal_train.config import ConfigError, load_expr_config, log_dir
from areal_train.metrics import MetricsLogger
from examples.math import arith
from examples.math.common import mean, reject_extras, save_checkpoint, start_trainer
from examples.math.smol_rl import (
    Curve,
    SmolGRPOConfig,
    _rollout,
    batches,
    evaluate,
    resolve_actor_path,
    service,
    task_split,
)

TAG = "[smol-async]"


@dataclass
class AsyncRLConfig:
    # η: how many weight versions a trained sample may lag (admission and export bound).
    max_staleness: int = 1
    # The behaviour importance weight pi_prox / pi_behav is clipped at this.
    behav_imp_weight_cap: float = 5.0
    # Groups rolled out at once (0 = train_dataset.batch_size x (η + 1)).
    rollout_workers: int = 0
    # A group is trained when at least this many members are usable (not failed, fresh).
    min_usable_group_size: int = 2
    # Export with loss_mask 0 on tokens older than η instead of dropping whole rows.
    mask_stale_tokens: bool = False


@dataclass
class SmolAsyncConfig(SmolGRPOConfig):
    async_rl: AsyncRLConfig = field(default_factory=AsyncRLConfig)


@dataclass
class GroupRollout:
    rows: list[Trajectory]
    results: list[dict[str, Any]]
    summary: dict[str, Any]


class EngineActivity:
    """How long at least one chat was in flight (the engine busy, as its clients see it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0
        self._busy = 0.0

    def start(self) -> None:
        with self._lock:
            if self._running == 0:
                self._since = time.monotonic()
            self._running += 1

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._busy += time.monotonic() - self._since

    def busy_s(self) -> float:
        with self._lock:
            extra = time.monotonic() - self._since if self._running else 0.0
            return self._busy + extra


def _failure(err: BaseException) -> str:
    """A failed chat's reason, as the session's end records it."""
    import openai

    if isinstance(err, openai.APITimeoutError):
        return "timeout"
    if isinstance(err, openai.BadRequestError | openai.UnprocessableEntityError):
        return "engine_refusal"
    return "client_error"


class Rollouts:
    """The rollout workers: groups started under admission, rolled out, exported, queued."""

    def __init__(
        self,
        client: ArealClient,
        config: SmolAsyncConfig,
        problems: list[arith.Problem],
        pool: ThreadPoolExecutor,
    ) -> None:
        self.client = client
        self.config = config
        self.pool = pool
        self.ready: queue.Queue[GroupRollout] = queue.Queue()
        self.stop = threading.Event()
        self.activity = EngineActivity()
        self.errors: list[BaseException] = []
        self.dropped_groups = 0
        # Groups admitted and not yet queued (or dropped).
        self.in_flight = 0
        self._problems = itertools.cycle(problems)
        self._lock = threading.Lock()
        a = config.async_rl
        self.selection = ExportSelection(
            max_staleness=a.max_staleness,
            mask_stale_tokens=a.mask_stale_tokens,
            min_usable_group_size=a.min_usable_group_size,
        )

    def _next_problem(self) -> arith.Problem:
        with self._lock:
            return next(self._problems)

    def _member(self, problem: arith.Problem, group: Any, i: int) -> dict[str, Any]:
        self.activity.start()
        try:
            return _rollout(self.client, self.config, problem, group, i)
        except Exception as e:
            why = _failure(e)
            self.client.end_session(group.sessions[i], failure=why)
            return {"text": "", "reward": 0.0, "failure": why}
        finally:
            self.activity.end()

    def _one_group(self) -> None:
        cfg = self.config
        problem = self._next_problem()
        try:
            group = self.client.start_group_when_admitted(
                problem.task_id, cfg.grpo.group_size, cfg.rollout.model_name, max_wait_s=5.0
            )
        except RateLimitError:
            return  # no room yet: look at the stop flag, then ask again
        with self._lock:
            self.in_flight += 1
        try:
            self._roll_out(problem, group)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _roll_out(self, problem: arith.Problem, group: Any) -> None:
        cfg = self.config
        futures = [
            self.pool.submit(self._member, problem, group, i) for i in range(cfg.grpo.group_size)
        ]
        results = [f.result() for f in futures]
        exported = self.client.export(
            group_id=group.group_id,
            style=cfg.grpo.export_style,
            discount=cfg.grpo.discount,
            remove_session=True,
            selection=self.selection,
        )
        summary = exported.summary
        if not exported.rows:
            with self._lock:
                self.dropped_groups += 1
            return
        self.ready.put(
            GroupRollout(
                exported.rows,
                results,
                {
                    "dropped_stale": summary.dropped_stale if summary else 0,
                    "dropped_failed_rows": summary.dropped_failed_rows if summary else 0,
                    "failed": len(summary.failed) if summary else 0,
                },
            )
        )

    def _work(self) -> None:
        try:
            while not self.stop.is_set():
                self._one_group()
        except BaseException as e:  # handed to the trainer loop, which stops the run
            self.errors.append(e)

    def start(self, n: int) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self._work, name=f"rollout-{i}", daemon=True) for i in range(n)
        ]
        for t in threads:
            t.start()
        return threads

    def take(self, n_groups: int) -> list[GroupRollout]:
        """`n_groups` groups, or fewer when some were dropped at export: admission counts a
        dropped group as consumed, so no other group takes its place before the next weight
        version, and the trainer goes on with what it has once nothing is in flight."""
        out: list[GroupRollout] = []
        idle_since: float | None = None
        while len(out) < n_groups:
            if self.errors:
                raise RuntimeError(f"a rollout worker failed: {self.errors[0]!r}") from (
                    self.errors[0]
                )
            try:
                out.append(self.ready.get(timeout=0.5))
                idle_since = None
                continue
            except queue.Empty:
                pass
            with self._lock:
                nothing_running = self.in_flight == 0
            if not (out and nothing_running):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 3.0:
                break
        return out


def set_admission(client: ArealClient, config: SmolAsyncConfig) -> dict[str, Any]:
    """The model's admission bounds for this run (a fresh consumed count)."""
    g = config.grpo
    body = {
        "max_staleness": config.async_rl.max_staleness,
        "batch_size": config.train_dataset.batch_size * g.group_size,
        "max_concurrent_rollouts": config.rollout.max_concurrent_rollouts,
        "reset_consumed": True,
    }
    r = client.http_client.put(
        f"{client.base_url}/admin/models/{config.rollout.model_name}/admission",
        json=body,
        headers={"Authorization": f"Bearer {config.rollout.admin_api_key}"},
    )
    if r.status_code != 200:
        raise RuntimeError(f"setting admission bounds: {r.status_code} {r.text[:300]}")
    return dict(r.json())


def main(args: list[str]) -> int:
    config, extras = load_expr_config(args, SmolAsyncConfig)
    reject_extras(extras)
    resolve_actor_path(config)
    train, held_out = task_split(config)
    g, a = config.grpo, config.async_rl
    if a.max_staleness < 0:
        raise ConfigError("'async_rl.max_staleness' must be >= 0")
    if not 2 <= a.min_usable_group_size <= g.group_size:
        raise ConfigError("'async_rl.min_usable_group_size' must be from 2 to grpo.group_size")
    if a.behav_imp_weight_cap <= 0:
        raise ConfigError("'async_rl.behav_imp_weight_cap' must be > 0")
    n_groups = config.train_dataset.batch_size
    steps = config.total_train_steps or (
        config.total_train_epochs * (len(train) // config.train_dataset.batch_size)
    )
    # The order problems are rolled out in: the synchronous example's batches, one after another.
    order = [p for batch in batches(train, n_groups, config.seed, steps) for p in batch]
    workers = a.rollout_workers or n_groups * (a.max_staleness + 1)
    run_dir = log_dir(config)
    metrics = MetricsLogger(run_dir / "metrics.jsonl", prefix=f"{TAG} ")
    evals = MetricsLogger(run_dir / "eval.jsonl", prefix=f"{TAG} eval ")
    curve = Curve(run_dir / "curve.csv")
    print(
        f"{TAG} run folder {run_dir}; model {config.actor.path}; {len(train)} training "
        f"problems, {len(held_out)} held out; {steps} steps of {n_groups} x {g.group_size}; "
        f"eta {a.max_staleness}, {workers} rollout workers",
        flush=True,
    )
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
        bounds = set_admission(client, config)
        print(f"{TAG} admission {json.dumps(bounds)}", flush=True)

        def run_eval(step: int, version: int) -> dict[str, Any]:
            ev = evaluate(client, key, config, held_out)
            evals.log(step, weight_version=version, **ev)
            return ev

        version = 0
        ev = run_eval(0, version)
        curve.add(
            step=0,
            weight_version=0,
            eval_accuracy=ev["accuracy"],
            eval_strict_accuracy=ev["strict_accuracy"],
            elapsed_s=round(time.monotonic() - t_start),
        )
        rollouts = Rollouts(client, config, order, pool)
        t_loop = time.monotonic()
        threads = rollouts.start(workers)
        trained_staleness: Counter[int] = Counter()
        samples = 0
        step = 0
        try:
            for step in range(1, steps + 1):
                if config.eval.max_minutes and time.monotonic() - t_start > 60 * (
                    config.eval.max_minutes
                ):
                    print(f"{TAG} time limit reached after {step - 1} steps", flush=True)
                    step -= 1
                    break
                t0 = time.monotonic()
                busy0 = rollouts.activity.busy_s()
                got = rollouts.take(n_groups)
                t_wait = time.monotonic() - t0
                rows = [r for gr in got for r in gr.rows if any(r.loss_mask)]
                results = [x for gr in got for x in gr.results]
                # What is trained, against the weights it is trained on (the export measured
                # it against the version at export; the trainer may have moved since).
                staleness = Counter(version - r.min_version for r in rows)
                trained_staleness.update(staleness)
                advantages = group_advantages(
                    [r.to_dict() for r in rows], std_normalize=g.adv_norm_std
                )
                stats = trainer.call(
                    "ppo_step",
                    rows=[
                        {
                            "input_ids": r.input_ids,
                            "loss_mask": r.loss_mask,
                            "logprobs": r.logprobs,
                            "advantage": adv,
                        }
                        for r, adv in zip(rows, advantages, strict=True)
                    ],
                    eps_clip=g.eps_clip,
                    kl_coef=g.kl_coef,
                    temperature=1.0,
                    ppo_epochs=g.ppo_epochs,
                    n_minibatches=g.n_minibatches,
                    decoupled=True,
                    behav_imp_weight_cap=a.behav_imp_weight_cap,
                )
                ckpt = save_checkpoint(trainer, run_dir, f"step_{step}", g.keep_checkpoints)
                version = client.update_weights(str(ckpt)).version
                samples += len(rows)
                step_s = time.monotonic() - t0
                reward_mean = mean([r.reward for r in rows])
                accuracy = mean([x["reward"] for x in results])
                metrics.log(
                    step,
                    weight_version=version,
                    rollout_versions=sorted({v for r in rows for v in r.output_versions}),
                    staleness={str(k): n for k, n in sorted(staleness.items())},
                    reward_mean=reward_mean,
                    train_accuracy=accuracy,
                    n_rows=len(rows),
                    failed_members=sum(gr.summary["failed"] for gr in got),
                    dropped_stale=sum(gr.summary["dropped_stale"] for gr in got),
                    dropped_groups=rollouts.dropped_groups,
                    loss=stats["loss"],
                    grad_norm=stats["grad_norm"],
                    clip_frac=stats["clip_frac"],
                    behav_weight_mean=stats["behav_weight_mean"],
                    behav_weight_clipped=stats["behav_weight_clipped"],
                    trainer_wait_s=round(t_wait, 2),
                    step_s=round(step_s, 2),
                    engine_busy=round((rollouts.activity.busy_s() - busy0) / max(step_s, 1e-9), 3),
                    checkpoint=str(ckpt),
                    sample=results[0]["text"],
                )
                row: dict[str, Any] = {
                    "step": step,
                    "weight_version": version,
                    "reward_mean": round(reward_mean, 4),
                    "train_accuracy": round(accuracy, 4),
                }
                if (config.eval.every and step % config.eval.every == 0) or step == steps:
                    ev = run_eval(step, version)
                    row.update(
                        eval_accuracy=ev["accuracy"], eval_strict_accuracy=ev["strict_accuracy"]
                    )
                curve.add(**row, elapsed_s=round(time.monotonic() - t_start))
        finally:
            loop_s = time.monotonic() - t_loop
            busy_s = rollouts.activity.busy_s()
            rollouts.stop.set()
            for th in threads:
                th.join(timeout=ro.request_timeout + 30)
        if curve.rows[-1]["eval_accuracy"] == "":
            ev = run_eval(step, version)
            curve.rows[-1].update(
                eval_accuracy=ev["accuracy"], eval_strict_accuracy=ev["strict_accuracy"]
            )
            curve.add(**curve.rows.pop())
    first, final = evals.records[0], evals.records[-1]
    # Over the steps (from waiting for rollouts to the weights pushed), as the synchronous
    # example's step_s: the held-out evaluations between steps are left out.
    steps_s = max(sum(r["step_s"] for r in metrics.records), 1e-9)
    waits = sum(r["trainer_wait_s"] for r in metrics.records)
    busy = sum(r["engine_busy"] * r["step_s"] for r in metrics.records)
    summary = {
        "steps": step,
        "weight_version": version,
        "max_staleness": a.max_staleness,
        "eval_accuracy_before": first["accuracy"],
        "eval_accuracy_after": final["accuracy"],
        "eval_strict_before": first["strict_accuracy"],
        "eval_strict_after": final["strict_accuracy"],
        "samples_per_minute": round(samples / steps_s * 60, 2),
        "trainer_idle": round(waits / steps_s, 3),
        "engine_idle": round(1 - busy / steps_s, 3),
        "engine_idle_with_evals": round(1 - busy_s / max(loop_s, 1e-9), 3),
        "trained_staleness": {str(k): n for k, n in sorted(trained_staleness.items())},
        "minutes": round((time.monotonic() - t_start) / 60, 1),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{TAG} done: {json.dumps(summary)}", flush=True)
    return 0
