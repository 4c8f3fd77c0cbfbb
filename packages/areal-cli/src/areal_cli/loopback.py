"""The preload that keeps an engine's listeners on loopback (native/loopback_bind.c).

Built once per source version with the C compiler on PATH into
`$XDG_CACHE_HOME/areal/native/` (default `~/.cache`), atomically, and reused.
Without a compiler the engine still starts; `shim()` says why it could not
build, and the launch prints it, since the engine may then listen on a
wildcard address.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from areal_cli.private_files import make_dir

SOURCE = Path(__file__).parent / "native" / "loopback_bind.c"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "areal" / "native"


@cache
def shim() -> tuple[str | None, str]:
    """(path of the shared object, "") or (None, why it is not available)."""
    src = SOURCE.read_bytes()
    out = _cache_dir() / f"loopback_bind-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if out.exists():
        return str(out), ""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc) on PATH to build the loopback-bind preload"
    make_dir(out.parent)
    fd, tmp = tempfile.mkstemp(prefix=".loopback_bind.", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            return None, f"building the loopback-bind preload failed: {done.stderr.strip()[:300]}"
        os.replace(tmp, out)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"building the loopback-bind preload failed: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(out), ""


def with_preload(env: dict[str, str], path: str) -> dict[str, str]:
    """`env` with `path` first in LD_PRELOAD, keeping what was there (env, then ours)."""
    rest = env.get("LD_PRELOAD") or os.environ.get("LD_PRELOAD") or ""
    parts = [path, *(p for p in rest.split(":") if p and p != path)]
    return {**env, "LD_PRELOAD": ":".join(parts)}
