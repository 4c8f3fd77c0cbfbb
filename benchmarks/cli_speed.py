"""How fast the `areal` CLI answers (hyperfine-like: N runs, median, min, max).

    uv run python benchmarks/cli_speed.py [--runs 10] [--lifecycle-runs 5]

Measures, each in a fresh process as a user would run it:
  - `areal --help`                       target <= 150 ms
  - `areal inf ps` (one running service) target <= 300 ms
  - `areal inf run --detach` (no model) until healthy, target <= 2 s  (needs the service binaries)
  - `areal inf stop` of that healthy service, target <= 1 s
plus the import time of `areal_cli.main` alone. "cpu ms" is the median user+sys
time of the CLI process itself (for run/stop the services' own start-up is not in it). Uses a temporary AREAL_HOME and
free loopback ports; everything it starts is stopped. Numbers depend on machine
load: the 2-core machines this project runs on are often shared.
"""

from __future__ import annotations

import argparse
import os
import resource
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


_cpu_log: list[float] = []


def timed(argv: list[str], env: dict[str, str]) -> float:
    """Wall seconds of one run; its CPU seconds (user + sys of the CLI process) go to _cpu_log."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    _cpu_log.append((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return took


def measure(argv: list[str], env: dict[str, str], n: int) -> tuple[list[float], list[float]]:
    start = len(_cpu_log)
    times = [timed(argv, env) for _ in range(n)]
    return times, _cpu_log[start:]


def summary(
    name: str, times: list[float], target: float | None, cpu: list[float] | None = None
) -> list[str]:
    med = statistics.median(times)
    ok = "" if target is None else ("yes" if med <= target else "NO")
    tgt = "-" if target is None else f"{target * 1000:.0f}"
    return [
        name,
        str(len(times)),
        f"{med * 1000:.0f}",
        f"{min(times) * 1000:.0f}",
        f"{max(times) * 1000:.0f}",
        f"{statistics.median(cpu) * 1000:.0f}" if cpu else "-",
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
    # Measure as a user runs it: bytecode cached after the first run (a warm-up run
    # per command writes it). With PYTHONDONTWRITEBYTECODE every run recompiles typer.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    areal = areal_cmd()
    rows = []
    try:
        timed([sys.executable, "-c", "import areal_cli.main"], env)  # warm-up
        bare = measure([sys.executable, "-c", "pass"], env, args.runs)
        imp = measure([sys.executable, "-c", "import areal_cli.main"], env, args.runs)
        rows.append(summary("python -c pass (baseline)", *bare[:1], None, bare[1]))
        rows.append(summary("python -c 'import areal_cli.main'", imp[0], None, imp[1]))
        timed([*areal, "--help"], env)  # warm the bytecode cache
        hlp = measure([*areal, "--help"], env, args.runs)
        rows.append(summary("areal --help", hlp[0], 0.150, hlp[1]))
        have_binaries = all(
            shutil.which(b, path=env["PATH"]) for b in ("areal-gateway", "areal-router")
        )
        if not have_binaries:
            print("service binaries not on PATH: only --help and an empty ps are measured")
            ps = measure([*areal, "inf", "ps"], env, args.runs)
            rows.append(summary("areal inf ps (no services)", ps[0], 0.300, ps[1]))
        else:
            runs: list[float] = []
            stops: list[float] = []
            pss: tuple[list[float], list[float]] = ([], [])
            timed([*areal, "inf", "ps"], env)  # warm-up
            for i in range(args.lifecycle_runs):
                port = str(free_port())
                runs.append(timed([*areal, "inf", "run", "--port", port, "--detach"], env))
                if i == 0:
                    pss = measure([*areal, "inf", "ps"], env, args.runs)
                stops.append(timed([*areal, "inf", "stop"], env))
            rows.append(summary("areal inf ps (1 service running)", pss[0], 0.300, pss[1]))
            rows.append(summary("areal inf run --detach (no model)", runs, 2.0))
            rows.append(summary("areal inf stop (healthy service)", stops, 1.0))
    finally:
        subprocess.run([*areal, "inf", "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(home, ignore_errors=True)

    headers = ["command", "runs", "median ms", "min ms", "max ms", "cpu ms", "target ms", "met"]
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
