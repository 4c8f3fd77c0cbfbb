"""The driver's side of the trainer process (examples/math/trainer.py): stdlib only.

    with TrainerClient.start(python, log_path) as trainer:
        trainer.call("init", model_path=..., optimizer={...})
        stats = trainer.call("sft_step", rows=rows)

The process runs in its own process group; `close()` asks it to exit, then
ends that group (only it) if it does not.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, TextIO

TRAINER_SCRIPT = Path(__file__).with_name("trainer.py")


class TrainerError(RuntimeError):
    """The trainer process failed a command, or died."""


def resolve_trainer_python(explicit: str = "") -> str:
    """The interpreter for the trainer: explicit, else the SGLang engine's python."""
    if explicit:
        if not Path(explicit).exists():
            raise TrainerError(f"actor.python does not exist: {explicit}")
        return explicit
    from areal_cli.engines import resolve_python

    try:
        return resolve_python("sglang")
    except Exception as e:  # areal_cli.errors.CLIError
        raise TrainerError(f"no python with torch for the trainer: {e}") from None


class TrainerClient:
    def __init__(self, proc: subprocess.Popen[str], log_path: Path, log: TextIO) -> None:
        self.proc = proc
        self.log_path = log_path
        self._log = log
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._next_id = 0
        self.info: dict[str, Any] = {}
        threading.Thread(target=self._read, daemon=True, name="trainer-stdout").start()

    @classmethod
    def start(
        cls,
        python: str,
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
    ) -> TrainerClient:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "a")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # The engine venv must not see the workspace's packages.
        full_env.pop("PYTHONPATH", None)
        full_env.pop("VIRTUAL_ENV", None)
        proc = subprocess.Popen(
            [python, str(TRAINER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=full_env,
            start_new_session=True,
        )
        client = cls(proc, log_path, log)
        try:
            ready = client._receive(start_timeout, "start")
            if ready.get("event") != "ready":
                raise TrainerError(f"trainer sent {ready!r} instead of its ready line")
            client.info = ready
        except BaseException:
            client.close()
            raise
        return client

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def _receive(self, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TrainerError(f"trainer did not answer '{what}' within {timeout:.0f}s")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                code = self.proc.wait()
                raise TrainerError(
                    f"trainer exited (code {code}) during '{what}'; log {self.log_path}: "
                    f"{self._tail()}"
                )
            line = line.strip()
            if not line:
                continue
            try:
                return dict(json.loads(line))
            except ValueError:
                raise TrainerError(f"trainer wrote a non-protocol line: {line[:200]!r}") from None

    def call(self, cmd: str, timeout: float = 600.0, **params: Any) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise TrainerError(f"trainer is not running (code {self.proc.returncode})")
        self._next_id += 1
        req_id = self._next_id
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"id": req_id, "cmd": cmd, **params}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise TrainerError(f"trainer is gone; log {self.log_path}: {self._tail()}") from None
        reply = self._receive(timeout, cmd)
        if reply.get("id") != req_id:
            raise TrainerError(f"trainer answered request {reply.get('id')}, expected {req_id}")
        if not reply.get("ok"):
            raise TrainerError(f"trainer '{cmd}' failed: {reply.get('error')}")
        return dict(reply.get("result") or {})

    def close(self, grace: float = 10.0) -> int | None:
        proc = self.proc
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({"id": 0, "cmd": "shutdown"}) + "\n")
                proc.stdin.flush()
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                # Its own process group (start_new_session): only what we started.
                for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        self._log.close()
        return proc.returncode

    def __enter__(self) -> TrainerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
