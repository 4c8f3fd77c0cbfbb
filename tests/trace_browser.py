"""Open a page written by `areal inf trace --html` in the system's headless Chromium
(Debian's `chromium`, which scripts/bootstrap.sh installs) through Playwright."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
# Without the networking switches Chromium waits on services it cannot reach here (a closed
# network: component updates, sync, QUIC probes) and hangs at start.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_chromium() -> None:
    """Skip where no Chromium is installed, except in CI (whose bootstrap installs it)."""
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: scripts/bootstrap.sh installs it")
        pytest.skip(f"{CHROMIUM} is not installed (scripts/bootstrap.sh installs it)")


@contextmanager
def open_page(path: Path, errors: list[str] | None = None) -> Iterator[Any]:
    """The page at `path`, loaded; page errors and console errors go to `errors`."""
    from playwright.sync_api import sync_playwright

    require_chromium()
    profile = tempfile.mkdtemp(prefix="trace-chromium-")
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(
                profile,
                executable_path=CHROMIUM,
                headless=True,
                args=FLAGS,
                viewport={"width": 1200, "height": 900},
                timeout=60_000,
            )
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                if errors is not None:
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    page.on(
                        "console",
                        lambda m: errors.append(m.text) if m.type == "error" else None,
                    )
                page.goto(path.resolve().as_uri())
                yield page
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
