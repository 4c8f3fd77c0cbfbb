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
