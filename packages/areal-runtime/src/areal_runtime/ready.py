"""The ready file a service writes once it listens (the CLI waits for it)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def write_private(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically with mode 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_ready_file(
    path: str | Path | None, *, host: str, port: int, version: str, **extra: Any
) -> None:
    if not path:
        return
    info = {
        "pid": os.getpid(),
        "host": host,
        "port": port,
        "version": version,
        "started_at": time.time(),
        **extra,
    }
    write_private(path, json.dumps(info).encode())
