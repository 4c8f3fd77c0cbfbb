"""`areal-router`: parse flags (and AREAL_ROUTER_* environment), then serve."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence

from areal_runtime.logs import exit_process, setup_logging


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when importable (cheaper per-callback and per-socket cost than asyncio's loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    from areal_router.settings import parse

    try:
        settings = parse(argv)
    except ValueError as exc:
        print(f"areal-router: error: {exc}", file=sys.stderr)
        return 2
    log = setup_logging(settings.log_level, "areal-router")

    from areal_router.server import serve

    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            code = runner.run(serve(settings))
    except ValueError as exc:  # e.g. an unreadable --state-file
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    if argv is None:  # the real program (tests call main with their own argv)
        exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
