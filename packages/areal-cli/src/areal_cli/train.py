"""`areal train run`: resolve `module.path:func`, call it with `--config <abs>` + overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Run a training driver with an experiment config.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _group() -> None:
    """Run a training driver with an experiment config."""


@app.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def run(
    ctx: typer.Context,
    config: Annotated[
        Path,
        typer.Option(
            "--config", exists=True, dir_okay=False, help="Experiment YAML path (must exist)."
        ),
    ],
    driver: Annotated[str, typer.Option("--driver", help="Driver entry point module.path:func.")],
) -> None:
    """Call the driver in-process with ["--config", <abs path>, *overrides].

    Trailing arguments (hydra-style key=value overrides, even --flags) are passed
    to the driver unchanged. An int return value is the exit code; anything else is 0.
    """
    func = resolve_driver(driver)
    result = func(["--config", str(config.resolve()), *ctx.args])
    raise typer.Exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


def resolve_driver(spec: str):
    import importlib
    import os
    import sys

    from areal_cli.errors import CLIError

    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise typer.BadParameter(
            f"'{spec}' is not in module.path:func form", param_hint="'--driver'"
        )
    # Like `python -m`, resolve modules from the current directory too.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CLIError(f"cannot import driver module '{module_name}': {e}") from None
    func = getattr(module, func_name, None)
    if func is None:
        raise CLIError(f"module '{module_name}' has no function '{func_name}'")
    if not callable(func):
        raise CLIError(f"'{module_name}:{func_name}' is not callable")
    return func
