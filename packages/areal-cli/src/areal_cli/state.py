"""Per-service state on disk, shared by `areal inf` and `areal agent`.

Layout under `$AREAL_HOME` (default `~/.areal`), `<group>` being `inf` or `agent`:

    <group>/services/<service>.json      the state (components, models, urls); mode 0600
    <group>/services/<service>.secrets   admin key and internal token; mode 0600
    <group>/services/<service>.lock      fcntl lock taken by commands that change the service
    <group>/run/<service>/<comp>.ready   ready files of the running components
    <group>/logs/<service>/<comp>.log    one log per component (kept after stop)

Secrets never go into the state file: they live in the separate 0600 secrets
file so `register`, `deregister` and `models` can call the admin API without
the key being passed again, while the state stays safe to show (`status --json`).
Files are written atomically (temp file in the same folder, fsync, os.replace);
every file is 0600 and every folder 0700 (private_files.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from areal_cli.config import areal_home
from areal_cli.errors import CLIError
from areal_cli.private_files import make_dir

GROUPS = ("inf", "agent")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name or ""):
        raise CLIError(
            f"invalid {kind} name '{name}': use letters, digits, '.', '_' and '-' "
            "(at most 64, starting with a letter or digit)",
            code=2,
        )
    return name


def group_dir(group: str) -> Path:
    assert group in GROUPS, group
    return areal_home() / group


def services_dir(group: str) -> Path:
    return group_dir(group) / "services"


def state_path(group: str, service: str) -> Path:
    return services_dir(group) / f"{service}.json"


def secrets_path(group: str, service: str) -> Path:
    return services_dir(group) / f"{service}.secrets"


def lock_path(group: str, service: str) -> Path:
    return services_dir(group) / f"{service}.lock"


def run_dir(group: str, service: str) -> Path:
    return group_dir(group) / "run" / service


def logs_dir(group: str, service: str) -> Path:
    return group_dir(group) / "logs" / service


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically with mode 0600."""
    make_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CLIError(f"corrupt state file {path}: {e}") from None
    if not isinstance(data, dict):
        raise CLIError(f"corrupt state file {path}: not a JSON object")
    return data


def load(group: str, service: str) -> dict[str, Any] | None:
    return _read_json(state_path(group, service))


def save(group: str, service: str, state: dict[str, Any]) -> None:
    state["updated_at"] = time.time()
    write_private(state_path(group, service), json.dumps(state, indent=2).encode())


def load_secrets(group: str, service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (_read_json(secrets_path(group, service)) or {}).items()}


def recorded_admin_key(group: str, service: str) -> str:
    """The admin key of a service whose state is still recorded (e.g. `stop --keep-state`),
    so that `run --force` over it keeps the key its clients hold; "" if none."""
    if not state_path(group, service).exists():
        return ""
    return load_secrets(group, service).get("admin_api_key", "")


def save_secrets(group: str, service: str, secrets: dict[str, str]) -> None:
    write_private(secrets_path(group, service), json.dumps(secrets).encode())


def remove(group: str, service: str) -> None:
    """Delete the state, the secrets and the ready files (logs are kept)."""
    for p in (state_path(group, service), secrets_path(group, service)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    rd = run_dir(group, service)
    if rd.is_dir():
        for f in rd.iterdir():
            with contextlib.suppress(OSError):
                f.unlink()
        with contextlib.suppress(OSError):
            rd.rmdir()


def list_services(group: str) -> list[str]:
    d = services_dir(group)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    return sorted(n[:-5] for n in names if n.endswith(".json") and not n.startswith("."))


def load_all(group: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in list_services(group):
        with contextlib.suppress(CLIError):
            if (st := load(group, name)) is not None:
                out[name] = st
    return out


class Lock:
    """An exclusive fcntl lock on `<service>.lock`, released on close or process exit."""

    def __init__(self, group: str, service: str) -> None:
        self.path = lock_path(group, service)
        self.service = service
        self.group = group
        self._fd: int | None = None

    def acquire(self, wait: float = 0.0) -> None:
        import fcntl

        make_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                    os.close(fd)
                    who = f" (pid {holder})" if holder.isdigit() else ""
                    raise CLIError(
                        f"{self.group} service '{self.service}' is busy: another areal "
                        f"command{who} is starting or changing it; try again when it is done"
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> Lock:
        if not self.held:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def locked(group: str, service: str, wait: float = 0.0) -> Iterator[Lock]:
    lock = Lock(group, service)
    lock.acquire(wait)
    try:
        yield lock
    finally:
        lock.release()
