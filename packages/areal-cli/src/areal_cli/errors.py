"""The one error type the CLI turns into a one-line message and an exit code."""

from __future__ import annotations


class CLIError(Exception):
    """A user-facing failure: printed as `error: <message>` with exit code `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
