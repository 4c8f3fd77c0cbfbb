"""Per-step metrics: one line on stdout and one JSON object per line in a file."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


class MetricsLogger:
    """Appends `{"step": n, "time": t, ...}` lines to `path` and echoes them."""

    def __init__(self, path: Path, stream: TextIO | None = None, prefix: str = "") -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = stream if stream is not None else sys.stdout
        self._prefix = prefix
        self.records: list[dict[str, Any]] = []

    def log(self, step: int, **values: Any) -> dict[str, Any]:
        record = {"step": step, "time": round(time.time(), 3), **values}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.records.append(record)
        shown = " ".join(
            f"{k}={_fmt(v)}" for k, v in values.items() if not isinstance(v, list | dict)
        )
        print(f"{self._prefix}step {step}: {shown}", file=self._stream, flush=True)
        return record


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
