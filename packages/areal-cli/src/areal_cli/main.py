"""The `areal` command: the typer app and `main`, the one place errors become exit codes.

Command modules are small typer wrappers; each imports its implementation
only when it runs, so `areal --help` stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

# Plain help output: typer's rich formatting costs ~0.5 s of imports per call.
os.environ.setdefault("TYPER_USE_RICH", "0")

import typer

from areal_cli.agent.commands import app as agent_app
from areal_cli.errors import CLIError
from areal_cli.inf.commands import app as inf_app
from areal_cli.train import app as train_app

app = typer.Typer(
    name="areal",
    help="Operator CLI for AReaL services: train, inference (inf) and agent.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(train_app, name="train")
app.add_typer(inf_app, name="inf")
app.add_typer(agent_app, name="agent")


def _version(value: bool) -> None:
    if value:
        from areal_cli import __version__

        print(f"areal {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; a CLIError becomes `error: <message>` and its exit code."""
    try:
        app(args=argv, prog_name="areal")
    except CLIError as e:
        sys.stdout.flush()
        print(f"error: {e.message}", file=sys.stderr)
        sys.exit(e.code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
