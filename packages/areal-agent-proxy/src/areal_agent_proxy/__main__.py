"""`areal-agent-proxy`: parse flags, then serve until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from areal_agent_proxy.settings import load_settings
from areal_runtime.logs import exit_process, setup_logging


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv)
    log = setup_logging(settings.log_level, "areal-agent-proxy")
    # gRPC's own debug lines (one per RPC) drown ours.
    logging.getLogger("grpc").setLevel(max(log.getEffectiveLevel(), logging.INFO))
    if problems := settings.problems():
        for p in problems:
            log.error(p)
        return 2
    from areal_agent_proxy.server import serve

    try:
        code = asyncio.run(serve(settings))
        if argv is None:  # the real program (tests call main with their own argv)
            exit_process(code)
        return code
    except (FileNotFoundError, ValueError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
