"""`areal agent` commands that work on any recorded agent service.

`run` lands with the agent launcher; ps / status / logs / stop already work on
what it records (components `gateway`, `router`, `worker-<i>`, `proxy-<i>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Manage local agent services (gateway, router, worker/data-proxy pairs).",
    no_args_is_help=True,
    add_completion=False,
)

Service = Annotated[
    str | None, typer.Option("--service", help="Service name [default: 'default'].")
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


@app.callback()
def _group(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Extra TOML config, over $AREAL_HOME/agent/config.toml.",
            dir_okay=False,
        ),
    ] = None,
) -> None:
    ctx.obj = config


def _cfg(ctx: typer.Context):
    from areal_cli import config

    return config.load("agent", ctx.obj)


@app.command()
def ps(
    ctx: typer.Context,
    as_json: Json = False,
    all_: Annotated[bool, typer.Option("--all", help="Include stale services.")] = False,
) -> None:
    """List agent services on this machine."""
    from areal_cli import lifecycle

    if ctx.obj is not None:
        _cfg(ctx)  # an explicit --config is validated even where no key applies
    raise typer.Exit(lifecycle.ps("agent", as_json=as_json, include_stale=all_))


@app.command()
def status(
    ctx: typer.Context,
    service: Service = None,
    as_json: Json = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
) -> None:
    """Per-component state: gateway, router and each pair's worker + proxy."""
    from areal_cli import lifecycle

    name = service or _cfg(ctx).get("default", "service") or "default"
    raise typer.Exit(
        lifecycle.status("agent", name, as_json=as_json, watch=watch, interval=interval)
    )


@app.command()
def logs(
    ctx: typer.Context,
    component: Annotated[
        str, typer.Option("--component", "-c", help="gateway, router, worker-<i>, proxy-<i>.")
    ],
    service: Service = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing (tail -F).")
    ] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines to show first.")] = 50,
) -> None:
    """Show a component's log."""
    from areal_cli import lifecycle

    name = service or _cfg(ctx).get("default", "service") or "default"
    raise typer.Exit(lifecycle.logs("agent", name, component, follow=follow, lines=lines))


@app.command()
def stop(
    ctx: typer.Context,
    service: Service = None,
    force: Annotated[bool, typer.Option("--force", help="SIGKILL at once.")] = False,
    grace: Annotated[
        float | None,
        typer.Option(
            "--grace-period", "--grace", help="Seconds between SIGTERM and SIGKILL [default: 10]."
        ),
    ] = None,
    keep_state: Annotated[
        bool, typer.Option("--keep-state", help="Stop the processes but keep <service>.json.")
    ] = False,
) -> None:
    """Stop every component and remove the state."""
    from areal_cli import lifecycle

    cfg = _cfg(ctx)
    name = service or cfg.get("default", "service") or "default"
    g = float(cfg.pick(grace, "stop", "grace_period", lifecycle.DEFAULT_GRACE))
    raise typer.Exit(lifecycle.stop("agent", name, force=force, grace=g, keep_state=keep_state))
