"""What `areal inf` and `areal agent` share on the command line: the group with its
--config, the `run` flags they spell alike, and the lifecycle commands ps / status /
logs / stop.

Thin typer wrappers like every command module; lifecycle and config are imported
only when a command runs, so `areal --help` stays fast.
"""

# No `from __future__ import annotations`: typer resolves string annotations in the
# module globals, but these commands' options carry per-group help from a closure.

from pathlib import Path
from typing import Annotated, Any

import typer

Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

# `run` flags that both groups spell and explain alike.
Host = Annotated[str | None, typer.Option(help="Gateway bind address [default: 127.0.0.1].")]
AdminApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="AREAL_ADMIN_API_KEY",
        help="Admin key of the gateway [default: generated]; kept in a 0600 file beside the state.",
        show_envvar=True,
    ),
]
Force = Annotated[
    bool,
    typer.Option(
        "--force", help="Stop whatever the existing state of this service records, then start."
    ),
]
Gateways = Annotated[
    int | None,
    typer.Option(
        help="Gateway processes sharing the port (SO_REUSEPORT), each supervised; any serves "
        "any request [default: 1].",
    ),
]
LogLevel = Annotated[str | None, typer.Option(help="debug, info, warning, error [default: info].")]
Supervise = Annotated[
    bool | None,
    typer.Option(
        "--supervise/--no-supervise",
        help="Restart dead or hung components with backoff (the watchdog) "
        "[default: [supervision] enabled, else on].",
    ),
]


def group_app(*, help: str, config_help: str) -> typer.Typer:
    """The `areal <group>` typer app; its `--config` file is what `load_config` reads."""
    app = typer.Typer(help=help, no_args_is_help=True, add_completion=False)

    @app.callback()
    def _group(
        ctx: typer.Context,
        config: Annotated[
            Path | None, typer.Option("--config", help=config_help, dir_okay=False)
        ] = None,
    ) -> None:
        ctx.obj = config

    return app


def load_config(group: str, ctx: typer.Context) -> Any:
    from areal_cli import config

    return config.load(group, ctx.obj)


def add_lifecycle_commands(
    app: typer.Typer,
    group: str,
    *,
    service_help: str,
    ps_help: str,
    status_help: str,
    component_help: str,
    stop_help: str,
) -> None:
    """Add ps / status / logs / stop to `app` (after the group's own commands: help lists
    them in the order they were added)."""
    service_opt = typer.Option("--service", help=service_help)

    def service_name(ctx: typer.Context, service: str | None) -> str:
        if service is not None:
            # `--service "$SVC"` with SVC unset must not quietly mean the default service.
            if not service.strip():
                raise typer.BadParameter("must not be empty", param_hint="--service")
            return service
        return load_config(group, ctx).get("default", "service") or "default"

    @app.command(help=ps_help)
    def ps(
        ctx: typer.Context,
        as_json: Json = False,
        all_: Annotated[bool, typer.Option("--all", help="Include stale services.")] = False,
    ) -> None:
        from areal_cli import lifecycle

        if ctx.obj is not None:
            load_config(group, ctx)  # an explicit --config is validated even where no key applies
        raise typer.Exit(lifecycle.ps(group, as_json=as_json, include_stale=all_))

    @app.command(help=status_help)
    def status(
        ctx: typer.Context,
        service: Annotated[str | None, service_opt] = None,
        as_json: Json = False,
        watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C.")] = False,
        interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
    ) -> None:
        from areal_cli import lifecycle

        name = service_name(ctx, service)
        raise typer.Exit(
            lifecycle.status(group, name, as_json=as_json, watch=watch, interval=interval)
        )

    @app.command(help="Show a component's log.")
    def logs(
        ctx: typer.Context,
        component: Annotated[str, typer.Option("--component", "-c", help=component_help)],
        service: Annotated[str | None, service_opt] = None,
        follow: Annotated[
            bool, typer.Option("--follow", "-f", help="Keep printing (tail -F).")
        ] = False,
        lines: Annotated[int, typer.Option("--lines", "-n", help="Lines to show first.")] = 50,
    ) -> None:
        from areal_cli import service_logs

        name = service_name(ctx, service)
        raise typer.Exit(service_logs.logs(group, name, component, follow=follow, lines=lines))

    @app.command(help=stop_help)
    def stop(
        ctx: typer.Context,
        service: Annotated[str | None, service_opt] = None,
        force: Annotated[bool, typer.Option("--force", help="SIGKILL at once.")] = False,
        grace: Annotated[
            float | None,
            typer.Option(
                "--grace-period",
                "--grace",
                help="Seconds between SIGTERM and SIGKILL [default: 10].",
            ),
        ] = None,
        keep_state: Annotated[
            bool, typer.Option("--keep-state", help="Stop the processes but keep <service>.json.")
        ] = False,
    ) -> None:
        from areal_cli import lifecycle

        name = service_name(ctx, service)
        cfg = load_config(group, ctx)
        g = float(cfg.pick(grace, "stop", "grace_period", lifecycle.DEFAULT_GRACE))
        if g < 0:
            raise typer.BadParameter("must be 0 or more", param_hint="--grace-period")
        raise typer.Exit(lifecycle.stop(group, name, force=force, grace=g, keep_state=keep_state))
