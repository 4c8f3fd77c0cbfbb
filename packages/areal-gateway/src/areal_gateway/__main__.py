"""`areal-gateway`: parse flags (and the environment), then serve."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from areal_gateway.settings import PROG, SettingsError, load_settings, validate
from areal_runtime import tls
from areal_runtime.logs import exit_process, setup_logging


def main(argv: Sequence[str] | None = None) -> None:
    try:
        settings = load_settings(argv)
        validate(settings)
        tls.config()  # a broken AREAL_TLS_* environment: this message, not a startup traceback
    except (SettingsError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_logging(settings.log_level, PROG)
    from areal_gateway.server import serve

    try:
        code = serve(settings)
    except OSError as exc:
        print(
            f"{PROG}: error: cannot listen on {settings.host}:{settings.port}: {exc}",
            file=sys.stderr,
        )
        code = 1
    if argv is None:  # the real program (tests call main with their own argv)
        exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
