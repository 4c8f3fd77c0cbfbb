"""Draw a GRPO run's curve.csv (examples/math/smol_rl.py) as a PNG.

    uv run --no-project --with matplotlib==3.11.2 python examples/math/plot_curve.py \\
        runs/smol_grpo/t1/curve.csv examples/math/smol_grpo_curve.png

matplotlib is needed only here (3.11.2: the release this was drawn with), not by the driver.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    src, out = Path(argv[0]), Path(argv[1])
    rows = list(csv.DictReader(src.open()))
    if not rows:
        print(f"plot_curve: {src} has no rows", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in ("", None)]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    x, y = series("reward_mean")
    ax.plot(x, y, ".-", color="#999999", lw=1, label="train reward (exact answer, T=1), per step")
    if len(y) >= 5:
        k = 5
        smooth = [
            sum(y[max(0, i - k + 1) : i + 1]) / len(y[max(0, i - k + 1) : i + 1])
            for i in range(len(y))
        ]
        ax.plot(x, smooth, color="#333333", lw=2, label="train reward, mean of last 5 steps")
    x, y = series("eval_accuracy")
    ax.plot(x, y, "o-", color="#d62728", lw=2, label="held-out accuracy (greedy, exact answer)")
    x, y = series("eval_strict_accuracy")
    ax.plot(x, y, "s--", color="#1f77b4", lw=1, label="held-out: the number alone")
    ax.set_xlabel("step (weight version)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("GRPO of SmolLM2-135M-Instruct on one-digit additions (CPU, 2 cores)")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    print(f"plot_curve: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
