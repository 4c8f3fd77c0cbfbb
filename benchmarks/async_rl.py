"""Synchronous vs asynchronous GRPO of SmolLM2-135M on the same task, seed and budget.

    uv run python benchmarks/async_rl.py \\
        [--steps 6] [--batch-size 2] [--group-size 4] [--n-eval 16] [--eval-every 2] \\
        [--etas 0,1,2] [--out async-rl-out]

Runs, one after another, each through `areal train run` with its own inference service:
`examples.math.smol_rl` (synchronous: roll out, train, push, roll out again) and
`examples.math.smol_async_rl` with η = each of `--etas` (rollouts under the service's
admission while the trainer trains; decoupled PPO). Then prints, side by side and as ratios to
the synchronous run: trained samples per minute of the training loop, the engine's idle
fraction (no chat in flight), the trainer's idle fraction (waiting for rollouts), the staleness
of what was trained (trainer version minus the row's oldest token's version), held-out
accuracy before and after, and the wall-clock minutes. The accuracy curves (held-out accuracy
against wall-clock seconds since each run started) go to <out>/curves.csv, and to
<out>/curves.png when matplotlib is installed (else, later:
`uv run --no-project --with matplotlib==3.11.2 python benchmarks/async_rl.py --plot CSV PNG`).

The synchronous example has no engine-activity probe: its engine idle fraction is the share of
each step spent outside the rollout phase (training, checkpoint, weight push), its trainer idle
fraction the share spent outside training. Needs the model (scripts/setup-model.sh).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AREAL = Path(sys.executable).with_name("areal")


def run(
    name: str, driver: str, config: str, out: Path, common: list[str], extra: list[str]
) -> Path:
    fileroot = out / "runs"
    cmd = [
        str(AREAL),
        "train",
        "run",
        "--config",
        config,
        "--driver",
        driver,
        "experiment_name=async_bench",
        f"trial_name={name}",
        f"cluster.fileroot={fileroot}",
        *common,
        *extra,
    ]
    env = {**os.environ, "AREAL_HOME": str(out / "areal-home" / name)}
    t0 = time.monotonic()
    print(f"[async_rl] {name}: {' '.join(cmd[1:])}", flush=True)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    (out / f"{name}.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    print(f"[async_rl] {name}: done in {time.monotonic() - t0:.0f} s", flush=True)
    return fileroot / "async_bench" / name


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sync_numbers(run_dir: Path) -> dict[str, Any]:
    steps = _records(run_dir / "metrics.jsonl")
    total = sum(r["step_s"] for r in steps)
    rollout = sum(r["rollout_s"] for r in steps)
    train = sum(r["train_s"] for r in steps)
    samples = sum(r["n_rows"] for r in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "samples_per_minute": samples / total * 60,
        "engine_idle": 1 - rollout / total,
        "trainer_idle": 1 - train / total,
        "trained_staleness": {"0": samples},
        "acc_before": summary["eval_accuracy_before"],
        "acc_after": summary["eval_accuracy_after"],
        "minutes": summary["minutes"],
    }


def async_numbers(run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "samples_per_minute": s["samples_per_minute"],
        "engine_idle": s["engine_idle"],
        "trainer_idle": s["trainer_idle"],
        "trained_staleness": s["trained_staleness"],
        "acc_before": s["eval_accuracy_before"],
        "acc_after": s["eval_accuracy_after"],
        "minutes": s["minutes"],
    }


def curve(run_dir: Path) -> list[tuple[float, float]]:
    rows = list(csv.DictReader((run_dir / "curve.csv").open()))
    return [(float(r["elapsed_s"]), float(r["eval_accuracy"])) for r in rows if r["eval_accuracy"]]


def plot(curves_csv: Path, png: Path) -> None:
    """Held-out accuracy against wall-clock minutes, one line per run (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[tuple[float, float]]] = {}
    for r in csv.DictReader(curves_csv.open()):
        runs.setdefault(r["run"], []).append((float(r["elapsed_s"]), float(r["eval_accuracy"])))
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in runs.items():
        # From the first evaluation (before step 1): service start-up times differ by run.
        t0 = pts[0][0]
        ax.plot([(t - t0) / 60 for t, _ in pts], [acc for _, acc in pts], marker="o", label=name)
    ax.set_xlabel("wall-clock minutes of training (from the evaluation before step 1)")
    ax.set_ylabel("held-out accuracy (greedy, exact answer)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--n-eval", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--etas", default="0,1,2")
    ap.add_argument("--no-sync", action="store_true", help="only the asynchronous runs")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "areal-async-rl")
    ap.add_argument(
        "--plot", nargs=2, type=Path, metavar=("CURVES_CSV", "PNG"), help="only draw a PNG"
    )
    a = ap.parse_args()
    if a.plot:
        plot(*a.plot)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    common = [
        f"seed={a.seed}",
        f"total_train_steps={a.steps}",
        f"train_dataset.batch_size={a.batch_size}",
        f"grpo.group_size={a.group_size}",
        f"task.n_eval={a.n_eval}",
        f"eval.every={a.eval_every}",
    ]
    results: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    if not a.no_sync:
        d = run(
            "sync", "examples.math.smol_rl:main", "examples/math/smol_grpo.yaml", a.out, common, []
        )
        results["sync"], curves["sync"] = sync_numbers(d), curve(d)
    for eta in [int(x) for x in a.etas.split(",") if x]:
        name = f"async_eta{eta}"
        d = run(
            name,
            "examples.math.smol_async_rl:main",
            "examples/math/smol_async.yaml",
            a.out,
            common,
            [f"async_rl.max_staleness={eta}"],
        )
        results[name], curves[name] = async_numbers(d), curve(d)
    base = results.get("sync")
    print(
        f"\nsteps {a.steps} x {a.batch_size} groups x {a.group_size}, held-out {a.n_eval}, "
        f"seed {a.seed}; 2 shared cores: engine and trainer on the same CPUs\n"
    )
    head = f"{'run':<12} {'samples/min':>18} {'engine idle':>12} {'trainer idle':>13} "
    print(head + f"{'acc before->after':>18} {'minutes':>8}  trained staleness")
    for name, r in results.items():
        spm = f"{r['samples_per_minute']:.1f}"
        if base and name != "sync":
            spm += f" ({r['samples_per_minute'] / base['samples_per_minute']:.2f}x)"
        print(
            f"{name:<12} {spm:>18} {r['engine_idle']:>12.2f} {r['trainer_idle']:>13.2f} "
            f"{r['acc_before']:>8.2f} -> {r['acc_after']:<6.2f} {r['minutes']:>8.1f}  "
            f"{json.dumps(r['trained_staleness'])}"
        )
    with open(a.out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "elapsed_s", "eval_accuracy"])
        for name, pts in curves.items():
            w.writerows([name, t, acc] for t, acc in pts)
    (a.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    try:
        plot(a.out / "curves.csv", a.out / "curves.png")
    except ImportError:
        print(f"\ncurves: {a.out / 'curves.csv'} (matplotlib not installed: no PNG; --plot)")
        return 0
    print(f"\ncurves: {a.out / 'curves.csv'}, {a.out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
