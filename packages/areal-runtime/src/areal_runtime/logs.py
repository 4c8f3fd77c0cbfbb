"""Logging set-up shared by the services: one line per event, secrets masked."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, name: str) -> logging.Logger:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
    )
    return logging.getLogger(name)


def mask(secret: str | None) -> str:
    """How a key may appear in a log line: its last 4 characters at most."""
    if not secret:
        return "<none>"
    return "…" + secret[-4:] if len(secret) > 12 else "<set>"


def exit_process(code: int) -> None:
    """End the process now, after an ordered shutdown has closed everything.

    The interpreter's own teardown (gRPC's background threads and channel
    finalizers) adds most of a second to every stop; nothing is left for it to
    do, so the process leaves without it once the logs are flushed.
    """
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
