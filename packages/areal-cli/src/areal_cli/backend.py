"""`--backend` grammar and GPU allocation for the local scheduler.

Grammar: `<engine>:<dims>` with engine `sglang` or `vllm` and dims any of
`d<N>` (data parallel: replicas), `t<N>` (tensor parallel: GPUs per replica),
`p<N>` (pipeline parallel) in any order, each at most once, N >= 1;
missing dims default to 1 (`sglang:` alone is one replica).

GPUs come from CUDA_VISIBLE_DEVICES when it is set, otherwise from the devices
present (`nvidia-smi -L`). A GPU is free when no replica recorded in any areal
state (inf or agent, any service) whose engine is still alive uses it; free
GPUs are handed out first to last, `t` per replica. With no GPU at all every
replica runs on the CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from areal_cli.components import Component
from areal_cli.errors import CLIError

ENGINES = ("sglang", "vllm")
_DIM = re.compile(r"([dtp])(\d+)")


@dataclass(frozen=True)
class Backend:
    engine: str
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __str__(self) -> str:
        return f"{self.engine}:d{self.dp}t{self.tp}p{self.pp}"


def parse(spec: str) -> Backend:
    """Parse `sglang:d2t1`; a CLIError (exit 2) says what is wrong."""
    hint = "expected <sglang|vllm>:<dims> with dims d<N>, t<N>, p<N> in any order, e.g. sglang:d2t1"
    engine, sep, dims = (spec or "").strip().partition(":")
    if not sep:
        raise CLIError(f"invalid --backend '{spec}': missing ':' ({hint})", code=2)
    engine = engine.strip().lower()
    if engine not in ENGINES:
        raise CLIError(
            f"invalid --backend '{spec}': unknown engine '{engine}' (known: sglang, vllm)", code=2
        )
    values: dict[str, int] = {}
    pos = 0
    dims = dims.strip().lower()
    while pos < len(dims):
        m = _DIM.match(dims, pos)
        if not m:
            raise CLIError(
                f"invalid --backend '{spec}': cannot parse '{dims[pos:]}' ({hint})", code=2
            )
        key, n = m.group(1), int(m.group(2))
        if key in values:
            raise CLIError(f"invalid --backend '{spec}': '{key}' given twice", code=2)
        if n < 1:
            raise CLIError(f"invalid --backend '{spec}': {key}{n} must be at least 1", code=2)
        values[key] = n
        pos = m.end()
    return Backend(engine, values.get("d", 1), values.get("t", 1), values.get("p", 1))


def check_local(backend: Backend) -> None:
    if backend.pp > 1:
        raise CLIError(
            f"--backend {backend}: pipeline parallelism is not supported (use p1)",
            code=2,
        )


def visible_gpus(env: Mapping[str, str] | None = None) -> list[int]:
    """GPU indices this process may use: CUDA_VISIBLE_DEVICES, else nvidia-smi -L."""
    cvd = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        out: list[int] = []
        for part in cvd.split(","):
            part = part.strip()
            if not part:
                continue
            if part.startswith("-") and part[1:].isdigit():
                break  # "-1" hides every device from there on
            if not part.isdigit():
                # UUIDs / MIG names cannot be mixed with indices here.
                raise CLIError(
                    f"CUDA_VISIBLE_DEVICES={cvd!r}: only comma-separated GPU indices are supported"
                )
            out.append(int(part))
        return out
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        res = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if res.returncode != 0:
        return []
    return [
        i for i, line in enumerate(ln for ln in res.stdout.splitlines() if ln.startswith("GPU"))
    ]


def allocate(backend: Backend, devices: Iterable[int], used: Iterable[int]) -> list[list[int]]:
    """GPUs per replica (one list per replica; empty lists when there is no GPU at all).

    `devices` are the visible GPUs in order, `used` the ones other replicas hold.
    """
    check_local(backend)
    devices = list(devices)
    if not devices:
        return [[] for _ in range(backend.dp)]
    taken = set(used)
    free = [g for g in devices if g not in taken]
    need = backend.dp * backend.tp
    if need > len(free):
        busy = [g for g in devices if g in taken]
        raise CLIError(
            f"--backend {backend} needs {need} GPUs ({backend.dp} replicas x {backend.tp}) but "
            f"only {len(free)} of {len(devices)} visible are free"
            + (f" (in use by other areal replicas: {busy})" if busy else "")
        )
    return [free[i * backend.tp : (i + 1) * backend.tp] for i in range(backend.dp)]


def used_gpus(states: Iterable[dict]) -> set[int]:
    """GPUs held by replicas whose engine is alive, over the given service states."""
    used: set[int] = set()
    for st in states:
        comps = st.get("components", {})
        for model in (st.get("models") or {}).values():
            for rep in model.get("replicas", []):
                c = comps.get(rep.get("worker", ""))
                if c and Component.from_dict(c).alive():
                    used.update(int(g) for g in rep.get("gpus", []))
    return used
