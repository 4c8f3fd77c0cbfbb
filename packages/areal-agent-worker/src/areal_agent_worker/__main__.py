"""`areal-agent-worker`: serve one user agent over gRPC."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from areal_agent_worker import __version__
from areal_agent_worker.settings import Settings
from areal_runtime.logs import exit_process, setup_logging
from areal_runtime.settings import parse_settings


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(
        Settings,
        argv,
        prog="areal-agent-worker",
        env_prefix="AREAL_AGENT_WORKER_",
        version=__version__,
        description="Serve one user agent class over gRPC.",
    )
    if not settings.agent:
        print(
            "areal-agent-worker: error: --agent is required (package.module.Class)", file=sys.stderr
        )
        return 2
    setup_logging(settings.log_level, "areal-agent-worker")
    code = asyncio.run(_serve(settings))
    if argv is None:  # the real program (tests call main with their own argv)
        exit_process(code)
    return code


async def _serve(settings: Settings) -> int:
    from areal_agent_worker.server import serve

    return await serve(settings)


if __name__ == "__main__":
    sys.exit(main())
