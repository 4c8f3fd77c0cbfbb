"""`areal <group> logs`: a component's log, or `tail -F` of it, shared by both groups.

A local component's log is its file under the service's logs folder (kept after `stop`);
one on a cluster node is read through its unit host.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from areal_cli import state as st
from areal_cli.cluster import ray_scheduler
from areal_cli.components import log_tail
from areal_cli.errors import CLIError
from areal_cli.reconcile import components


def available_logs(group: str, service: str) -> list[str]:
    names: set[str] = set()
    s = st.load(group, service)
    if s:
        names.update(components(s))
    d = st.logs_dir(group, service)
    if d.is_dir():
        names.update(p.stem for p in d.glob("*.log"))
    return sorted(names)


def logs(group: str, service: str, component: str, *, follow: bool, lines: int) -> int:
    st.check_name("service", service)
    if lines < 0:
        raise CLIError("-n must be 0 or more", code=2)
    s = st.load(group, service)
    path: Path | None = None
    rec = (s.get("components") or {}).get(component) if s else None
    if s and rec and (rec.get("meta") or {}).get("actor"):
        return _remote_logs(s, rec, follow=follow, lines=lines)
    if s and component in (s.get("components") or {}):
        path = Path(s["components"][component]["log"])
    elif "/" not in component and component not in ("", ".", ".."):
        path = st.logs_dir(group, service) / f"{component}.log"
    if path is None or not path.is_file():
        avail = available_logs(group, service)
        if not avail:
            raise CLIError(f"no logs for {group} service '{service}'")
        raise CLIError(
            f"no log for component '{component}' of {group} service '{service}'; "
            f"available: {', '.join(avail)}"
        )
    out = sys.stdout
    if lines:
        text = log_tail(path, lines)
        if text:
            out.write(text + "\n")
    out.flush()
    if follow:
        try:
            _follow(path)
        except KeyboardInterrupt:
            pass
    return 0


def _remote_logs(s: dict[str, Any], rec: dict[str, Any], *, follow: bool, lines: int) -> int:
    """A component's log from the node it runs on, read through its host."""
    # The last `lines` lines: read the last 64 KiB, as log_tail does for a local file.
    data, offset = ray_scheduler.read_log(s, rec, -64 * 1024)
    if lines:
        text = b"\n".join(data.splitlines()[-lines:])
        if text:
            sys.stdout.buffer.write(text + b"\n")
    sys.stdout.flush()
    if not follow:
        return 0
    try:
        while True:
            data, new = ray_scheduler.read_log(s, rec, offset)
            if new < offset:  # replaced: from its start
                data, new = ray_scheduler.read_log(s, rec, 0)
            if data:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            else:
                time.sleep(0.3)
            offset = new
    except KeyboardInterrupt:
        return 0


def _follow(path: Path) -> None:
    """tail -F: keep reading; reopen when the file is replaced or truncated."""
    f = None
    ino = None
    pos = 0
    try:
        try:
            f = open(path, "rb")
            f.seek(0, os.SEEK_END)
            pos = f.tell()
            ino = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            pass
        while True:
            if f is not None:
                chunk = f.read()
                if chunk:
                    pos += len(chunk)
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
                    continue
            time.sleep(0.2)
            try:
                info = os.stat(path)
            except FileNotFoundError:
                continue
            if f is None or info.st_ino != ino or info.st_size < pos:
                if f is not None:
                    f.close()
                f = open(path, "rb")
                ino = os.fstat(f.fileno()).st_ino
                pos = 0
    finally:
        if f is not None:
            f.close()
