"""`areal inf` commands: thin typer wrappers; the work is imported lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Launch and manage a local inference service (gateway, router, engines, data proxies).",
    no_args_is_help=True,
    add_completion=False,
)

Service = Annotated[
    str | None,
    typer.Option("--service", help="Service name [default: [default] service or 'default']."),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


@app.callback()
def _group(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Extra TOML config, over $AREAL_HOME/inf/config.toml (flags win over both).",
            dir_okay=False,
        ),
    ] = None,
) -> None:
    ctx.obj = config


def _cfg(ctx: typer.Context):
    from areal_cli import config

    return config.load("inf", ctx.obj)


def _service(ctx: typer.Context, service: str | None) -> str:
    if service is not None:
        return service
    return _cfg(ctx).get("default", "service") or "default"


@app.command(no_args_is_help=False)
def run(
    ctx: typer.Context,
    service: Service = None,
    host: Annotated[
        str | None, typer.Option(help="Gateway bind address [default: 127.0.0.1].")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port [default: 8080].")] = None,
    admin_api_key: Annotated[
        str | None,
        typer.Option(
            envvar="AREAL_ADMIN_API_KEY",
            help="Admin key of the gateway [default: generated]; kept in a 0600 file beside the state.",
            show_envvar=True,
        ),
    ] = None,
    scheduler: Annotated[
        str | None, typer.Option(help="Scheduling backend; only 'local' [default: local].")
    ] = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            help="Return once every component is healthy and leave the service running in the "
            "background (without it, run stays in the foreground and Ctrl-C stops everything).",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Stop whatever the existing state of this service records, then start."
        ),
    ] = False,
    routing_strategy: Annotated[
        str | None,
        typer.Option(
            help="Router policy: round_robin, least_loaded, power_of_two, session_affinity, "
            "cache_aware [default: round_robin]."
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning, error [default: info].")
    ] = None,
    launch_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds the gateway, router and each proxy get to be ready [default: 30]."
        ),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Register this model name at start.")] = None,
    backend: Annotated[
        str | None,
        typer.Option(help="<sglang|vllm>:d<N>t<N>p<N> [default: sglang:d1]."),
    ] = None,
    model_path: Annotated[str | None, typer.Option(help="Model folder or id.")] = None,
    tokenizer_path: Annotated[
        str | None, typer.Option(help="Tokenizer folder [default: the model path].")
    ] = None,
    engine_args: Annotated[
        str | None, typer.Option(help="Shell-style string appended to the engine's arguments.")
    ] = None,
    proxy_args: Annotated[
        str | None,
        typer.Option(help="Shell-style string appended to each data proxy's arguments."),
    ] = None,
    model_health_timeout: Annotated[
        float | None, typer.Option(help="Seconds each engine gets to be healthy [default: 600].")
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
    """Start an inference service: router, gateway and, with --model, a model's replicas."""
    from areal_cli.inf import launch

    opts = launch.RunOptions(
        service=service,
        host=host,
        port=port,
        admin_api_key=admin_api_key,
        scheduler=scheduler,
        detach=detach,
        force=force,
        routing_strategy=routing_strategy,
        log_level=log_level,
        launch_timeout=launch_timeout,
        supervise=supervise,
        model=launch.ModelOptions(
            name=model,
            backend=backend,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            engine_args=engine_args,
            proxy_args=proxy_args,
            health_timeout=model_health_timeout,
        ),
    )
    raise typer.Exit(launch.run(_cfg(ctx), opts))


@app.command()
def register(
    ctx: typer.Context,
    model_name: Annotated[str, typer.Option("--model-name", help="Name clients use as 'model'.")],
    service: Service = None,
    backend: Annotated[
        str | None, typer.Option(help="<sglang|vllm>:d<N>t<N>p<N> [default: sglang:d1].")
    ] = None,
    model_path: Annotated[str | None, typer.Option(help="Model folder or id.")] = None,
    tokenizer_path: Annotated[
        str | None, typer.Option(help="Tokenizer folder [default: the model path].")
    ] = None,
    engine_args: Annotated[
        str | None, typer.Option(help="Shell-style string appended to the engine's arguments.")
    ] = None,
    proxy_args: Annotated[
        str | None,
        typer.Option(help="Shell-style string appended to each data proxy's arguments."),
    ] = None,
    model_health_timeout: Annotated[
        float | None, typer.Option(help="Seconds each engine gets to be healthy [default: 600].")
    ] = None,
) -> None:
    """Launch engine replica(s) and data proxies for a model and register them with the gateway."""
    from areal_cli.inf import launch

    opts = launch.ModelOptions(
        name=model_name,
        backend=backend,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        engine_args=engine_args,
        proxy_args=proxy_args,
        health_timeout=model_health_timeout,
    )
    raise typer.Exit(launch.register(_cfg(ctx), service, opts))


@app.command()
def deregister(
    ctx: typer.Context,
    model_name: Annotated[str, typer.Option("--model-name", help="The model to remove.")],
    service: Service = None,
) -> None:
    """Remove a model from the gateway, then stop its data proxies and engines."""
    from areal_cli.inf import launch

    raise typer.Exit(launch.deregister(_cfg(ctx), service, model_name))


@app.command()
def models(ctx: typer.Context, service: Service = None, as_json: Json = False) -> None:
    """List the models of a service (the gateway's registry merged with local state)."""
    from areal_cli.inf import launch

    raise typer.Exit(launch.models(_cfg(ctx), service, as_json))


@app.command()
def ps(
    ctx: typer.Context,
    as_json: Json = False,
    all_: Annotated[bool, typer.Option("--all", help="Include stale services.")] = False,
) -> None:
    """List inference services on this machine."""
    from areal_cli import lifecycle

    if ctx.obj is not None:
        _cfg(ctx)  # an explicit --config is validated even where no key applies
    raise typer.Exit(lifecycle.ps("inf", as_json=as_json, include_stale=all_))


@app.command()
def status(
    ctx: typer.Context,
    service: Service = None,
    as_json: Json = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
) -> None:
    """Per-component state of one service (gateway, router, workers, data proxies)."""
    from areal_cli import lifecycle

    name = _service(ctx, service)
    raise typer.Exit(lifecycle.status("inf", name, as_json=as_json, watch=watch, interval=interval))


@app.command()
def logs(
    ctx: typer.Context,
    component: Annotated[
        str,
        typer.Option(
            "--component", "-c", help="gateway, router, <model>-worker-<i>, <model>-data-proxy-<i>."
        ),
    ],
    service: Service = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing (tail -F).")
    ] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines to show first.")] = 50,
) -> None:
    """Show a component's log."""
    from areal_cli import lifecycle

    raise typer.Exit(
        lifecycle.logs("inf", _service(ctx, service), component, follow=follow, lines=lines)
    )


@app.command()
def stop(
    ctx: typer.Context,
    service: Service = None,
    force: Annotated[bool, typer.Option("--force", help="SIGKILL at once.")] = False,
    grace: Annotated[
        float | None,
        typer.Option(
            "--grace",
            "--grace-period",
            help="Seconds between SIGTERM and SIGKILL [default: 10].",
        ),
    ] = None,
    keep_state: Annotated[
        bool, typer.Option("--keep-state", help="Stop the processes but keep <service>.json.")
    ] = False,
) -> None:
    """Stop every component (proxies, engines, gateway, router) and remove the state."""
    from areal_cli import lifecycle

    cfg = _cfg(ctx)
    name = service or cfg.get("default", "service") or "default"
    g = float(cfg.pick(grace, "stop", "grace_period", lifecycle.DEFAULT_GRACE))
    if g < 0:
        raise typer.BadParameter("must be 0 or more", param_hint="--grace")
    raise typer.Exit(lifecycle.stop("inf", name, force=force, grace=g, keep_state=keep_state))
