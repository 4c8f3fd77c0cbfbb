"""`areal agent` commands: thin typer wrappers; the work is imported lazily.

`run` is in agent/launch.py; ps / status / logs / stop are the shared lifecycle
(components `gateway`, `router`, `worker-<i>`, `proxy-<i>`).
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


@app.command(no_args_is_help=False)
def run(
    ctx: typer.Context,
    service: Service = None,
    agent: Annotated[
        str | None,
        typer.Option(
            help="Import path of the agent class, package.module.Class (required; or [run] "
            "agent). The caller's working directory is put first on the workers' PYTHONPATH."
        ),
    ] = None,
    num_pairs: Annotated[
        int | None, typer.Option(help="Worker/data-proxy pairs to start [default: 1].")
    ] = None,
    admin_api_key: Annotated[
        str | None,
        typer.Option(
            envvar="AREAL_ADMIN_API_KEY",
            help="Admin key of the gateway [default: generated]; kept in a 0600 file beside the state.",
            show_envvar=True,
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Stop whatever the existing state of this service records, then start."
        ),
    ] = False,
    setup_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds every component gets to become healthy [default: 120]."),
    ] = None,
    health_poll_interval: Annotated[
        float | None, typer.Option(help="Seconds between health polls during setup [default: 5].")
    ] = None,
    drain_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds each component drains in-flight work on SIGTERM [default: 30]."),
    ] = None,
    session_timeout: Annotated[
        float | None, typer.Option(help="Seconds an idle agent session lives [default: 1800].")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning, error [default: info].")
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Gateway bind address [default: 127.0.0.1].")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Gateway port [default: 0 = the OS picks; see status].")
    ] = None,
    routing_strategy: Annotated[
        str | None,
        typer.Option(
            help="Router policy for new sessions [default: session_affinity: least loaded, then "
            "sticky]."
        ),
    ] = None,
    inf_service: Annotated[
        str | None,
        typer.Option(
            help="Link a running `areal inf` service: the agent's LLM calls go through its "
            "gateway (URL and admin key read from its state)."
        ),
    ] = None,
    inf_gateway_url: Annotated[
        str | None,
        typer.Option(help="Link an inference gateway by URL (with --inf-admin-api-key)."),
    ] = None,
    inf_admin_api_key: Annotated[
        str | None, typer.Option(help="Admin key of the --inf-gateway-url gateway.")
    ] = None,
    inf_model: Annotated[
        str | None,
        typer.Option(
            help="Model the agent's LLM calls use [default: the linked service's only model]."
        ),
    ] = None,
    supervise: Annotated[
        bool | None,
        typer.Option(
            "--supervise/--no-supervise",
            help="Restart dead or hung components with backoff (the watchdog) "
            "[default: [supervision] enabled, else on].",
        ),
    ] = None,
) -> None:
    """Start an agent service (router, gateway, N worker/data-proxy pairs) and return."""
    from areal_cli.agent import launch

    opts = launch.RunOptions(
        service=service,
        agent=agent,
        num_pairs=num_pairs,
        admin_api_key=admin_api_key,
        force=force,
        setup_timeout=setup_timeout,
        health_poll_interval=health_poll_interval,
        drain_timeout=drain_timeout,
        session_timeout=session_timeout,
        log_level=log_level,
        host=host,
        port=port,
        routing_strategy=routing_strategy,
        inf_service=inf_service,
        inf_gateway_url=inf_gateway_url,
        inf_admin_api_key=inf_admin_api_key,
        inf_model=inf_model,
        supervise=supervise,
    )
    raise typer.Exit(launch.run(_cfg(ctx), opts))


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
