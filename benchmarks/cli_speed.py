"""How fast the `areal` CLI answers (hyperfine-like: N runs, median, min, max).

    uv run python benchmarks/cli_speed.py [--runs 10] [--lifecycle-runs 5]

Measures, each in a fresh process as a user would run it:
  - `areal --help`                       target <= 150 ms
  - `areal inf ps` (one running service) target <= 300 ms
  - `areal inf run --detach` (no model) until healthy, target <= 2 s  (needs the service binaries)
  - `areal inf stop` of that healthy service, target <= 1 s
plus the import time of `areal_cli.main` alone. Uses a temporary AREAL_HOME and
free loopback ports; everything it starts is stopped. Numbers depend on machine
load: the 2-core machines this project runs on are often shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def areal_cmd() -> list[str]:
    exe = shutil.which("areal") or (str(BIN / "areal") if (BIN / "areal").exists() else None)
    return [exe] if exe else [sys.executable, "-m", "areal_cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return took


def summary(name: str, times: list[float], target: float | None) -> list[str]:
    med = statistics.median(times)
    ok = "" if target is None else ("yes" if med <= target else "NO")
    tgt = "-" if target is None else f"{target * 1000:.0f}"
    return [
        name,
        str(len(times)),
        f"{med * 1000:.0f}",
        f"{min(times) * 1000:.0f}",
        f"{max(times) * 1000:.0f}",
        tgt,
        ok,
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="runs of --help and ps")
    ap.add_argument("--lifecycle-runs", type=int, default=5, help="runs of run --detach + stop")
    args = ap.parse_args()

    home = tempfile.mkdtemp(prefix="areal-bench-home-")
    env = {k: v for k, v in os.environ.items() if k != "AREAL_ADMIN_API_KEY"}
    env["AREAL_HOME"] = home
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    areal = areal_cmd()
    rows = []
    try:
        imp = [
            timed([sys.executable, "-c", "import areal_cli.main"], env) for _ in range(args.runs)
        ]
        bare = [timed([sys.executable, "-c", "pass"], env) for _ in range(args.runs)]
        rows.append(summary("python -c pass (baseline)", bare, None))
        rows.append(summary("python -c 'import areal_cli.main'", imp, None))
        timed([*areal, "--help"], env)  # warm the bytecode cache
        rows.append(
            summary(
                "areal --help", [timed([*areal, "--help"], env) for _ in range(args.runs)], 0.150
            )
        )
        have_binaries = all(
            shutil.which(b, path=env["PATH"]) for b in ("areal-gateway", "areal-router")
        )
        if not have_binaries:
            print("service binaries not on PATH: only --help and an empty ps are measured")
            rows.append(
                summary(
                    "areal inf ps (no services)",
                    [timed([*areal, "inf", "ps"], env) for _ in range(args.runs)],
                    0.300,
                )
            )
        else:
            runs, stops, pss = [], [], []
            for i in range(args.lifecycle_runs):
                port = str(free_port())
                runs.append(timed([*areal, "inf", "run", "--port", port, "--detach"], env))
                if i == 0:
                    pss = [timed([*areal, "inf", "ps"], env) for _ in range(args.runs)]
                stops.append(timed([*areal, "inf", "stop"], env))
            rows.append(summary("areal inf ps (1 service running)", pss, 0.300))
            rows.append(summary("areal inf run --detach (no model)", runs, 2.0))
            rows.append(summary("areal inf stop (healthy service)", stops, 1.0))
    finally:
        subprocess.run([*areal, "inf", "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)

    headers = ["command", "runs", "median ms", "min ms", "max ms", "target ms", "met"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*headers))
    for r in rows:
        print(line.format(*r))
    try:
        load = os.getloadavg()[0]
        print(f"\nload average (1 min) at the end: {load:.2f} on {os.cpu_count()} CPUs")
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
