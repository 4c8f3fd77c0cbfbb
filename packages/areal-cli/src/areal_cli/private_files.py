"""Files and folders the CLI makes: 0600 files in 0700 folders, always.

`Path.mkdir(parents=True, mode=0o700)` gives the mode to the last folder only
(parents get the default, usually 0755), and a process's umask decides the mode
of every file a child service creates (SQLite's -wal/-shm, an engine's logs).
So each missing folder is made and chmod-ed one by one, and children are
started with `CHILD_UMASK`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

# Given to every process the CLI starts: what it creates is 0600 / 0700.
CHILD_UMASK = 0o077


def make_dir(path: Path) -> Path:
    """Create `path` and any missing parents, each with mode 0700."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made by a concurrent command; its maker set the mode
        os.chmod(d, 0o700)
    return path


def open_append(path: Path) -> BinaryIO:
    """Open a log for appending, unbuffered, created with mode 0600."""
    make_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return os.fdopen(fd, "ab", buffering=0)
