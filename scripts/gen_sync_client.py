"""Generate the sync `ArealClient` (client.py) from the async one (async_client.py).

    uv run python scripts/gen_sync_client.py          # write client.py
    uv run python scripts/gen_sync_client.py --check  # CI: fail if client.py is not generated

unasync (as httpcore generates its sync half) drops `async` / `await` and renames the async
names below; the result's imports are sorted and it is ruff-formatted, so client.py is exactly what this script makes.
Edit async_client.py (or `_api.py`, which both share), never client.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "packages" / "areal-client" / "src" / "areal_client"
SOURCE = PKG / "async_client.py"
TARGET = PKG / "client.py"

# unasync's own table covers __aenter__, AsyncIterator and the like; these are httpx's and ours.
RENAMES = {
    "AsyncArealClient": "ArealClient",
    "AsyncClient": "Client",
    "AsyncBaseTransport": "BaseTransport",
    "aclose": "close",
    "aread": "read",
    "aiter_lines": "iter_lines",
    "async_sleep": "sleep",
}
HEADER = (
    "# Generated from async_client.py by scripts/gen_sync_client.py (unasync): do not edit;\n"
    "# edit async_client.py and run the script.\n"
)


def generate() -> str:
    """client.py's text, formatted as ruff formats the repository."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "aio" / SOURCE.name
        src.parent.mkdir()
        shutil.copy(SOURCE, src)
        unasync.unasync_files([str(src)], [unasync.Rule("/aio/", "/sync/", RENAMES)])
        text = HEADER + (Path(tmp) / "sync" / SOURCE.name).read_text()
    # Renamed imports may fall out of order: sort them, then format.
    for ruff in (["check", "--fix", "--select", "I", "--quiet"], ["format"]):
        text = subprocess.run(
            [sys.executable, "-m", "ruff", *ruff, "--stdin-filename", str(TARGET), "-"],
            input=text,
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if client.py differs")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if TARGET.read_text() != text:
            print(
                f"{TARGET.name} is not what scripts/gen_sync_client.py makes from "
                "async_client.py: edit async_client.py, then run the script"
            )
            return 1
        print("--- client.py is generated from async_client.py")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
