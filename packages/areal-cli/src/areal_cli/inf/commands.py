"""`areal inf` commands: thin typer wrappers; the work is imported lazily."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from areal_cli import service_commands as sc
from areal_cli.service_commands import (
    AdminApiKey,
    Force,
    Gateways,
    Host,
    Json,
    LogLevel,
    Supervise,
)

GROUP = "inf"
SERVICE_HELP = "Service name [default: [default] service or 'default']."

app = sc.group_app(
    help="Launch and manage a local inference service (gateway, router, engines, data proxies).",
    config_help="Extra TOML config, over $AREAL_HOME/inf/config.toml (flags win over both).",
)

Service = Annotated[str | None, typer.Option("--service", help=SERVICE_HELP)]
# One definition for `run --model` and `register`, so their model flags cannot drift apart.
Backend = Annotated[
    str | None, typer.Option(help="<sglang|vllm>:d<N>t<N>p<N> [default: sglang:d1].")
]
ModelPath = Annotated[
    str | None,
    typer.Option(
        help="Model folder or id, or a short name set up by scripts/setup-model.sh (smollm2)."
    ),
]
TokenizerPath = Annotated[
    str | None, typer.Option(help="Tokenizer folder [default: the model path].")
]
EngineArgs = Annotated[
    str | None, typer.Option(help="Shell-style string appended to the engine's arguments.")
]
ProxyArgs = Annotated[
    str | None, typer.Option(help="Shell-style string appended to each data proxy's arguments.")
]
ModelHealthTimeout = Annotated[
    float | None, typer.Option(help="Seconds each engine gets to be healthy [default: 600].")
]
# Admission control (docs/services.md, "Admission"): unset = no bound.
MaxStaleness = Annotated[
    int | None,
    typer.Option(
        help="Admission: η, how many weight versions a sample may lag (with --batch-size): "
        "a start is admitted while running + ended + consumed + n <= "
        "(η + version + 1) x batch_size [default: no bound]."
    ),
]
BatchSize = Annotated[
    int | None,
    typer.Option(help="Admission: samples the trainer consumes per weight version."),
]
MaxConcurrentRollouts = Annotated[
    int | None,
    typer.Option(help="Admission: at most this many sessions running [default: no bound]."),
]


@app.command(no_args_is_help=False)
def run(
    ctx: typer.Context,
    service: Service = None,
    host: Host = None,
    port: Annotated[int | None, typer.Option(help="Gateway port [default: 8080].")] = None,
    gateways: Gateways = None,
    admin_api_key: AdminApiKey = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            help="Scheduling backend: 'local' (this machine) or 'ray' (an existing Ray cluster "
            "this node belongs to; needs areal-cli[ray]; docs/cluster.md) [default: local]."
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="With --scheduler ray: the cluster's HOST:PORT, or 'auto' for the one this "
            "node runs [default: [scheduler] address, $RAY_ADDRESS, auto]."
        ),
    ] = None,
    detach: Annotated[
        bool,
        typer.Option(
            "--detach",
            help="Return once every component is healthy and leave the service running in the "
            "background (without it, run stays in the foreground and Ctrl-C stops everything).",
        ),
    ] = False,
    force: Force = False,
    routing_strategy: Annotated[
        str | None,
        typer.Option(
            help="Router policy: round_robin, least_loaded, power_of_two, session_affinity, "
            "cache_aware [default: round_robin]."
        ),
    ] = None,
    log_level: LogLevel = None,
    launch_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds the gateway, router and each proxy get to be ready [default: 30]."
        ),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Register this model name at start.")] = None,
    backend: Backend = None,
    model_path: ModelPath = None,
    tokenizer_path: TokenizerPath = None,
    engine_args: EngineArgs = None,
    proxy_args: ProxyArgs = None,
    model_health_timeout: ModelHealthTimeout = None,
    max_staleness: MaxStaleness = None,
    batch_size: BatchSize = None,
    max_concurrent_rollouts: MaxConcurrentRollouts = None,
    supervise: Supervise = None,
) -> None:
    """Start an inference service: router, gateway and, with --model, a model's replicas."""
    from areal_cli.inf import launch

    opts = launch.RunOptions(
        service=service,
        host=host,
        port=port,
        gateways=gateways,
        admin_api_key=admin_api_key,
        scheduler=scheduler,
        ray_address=ray_address,
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
            max_staleness=max_staleness,
            batch_size=batch_size,
            max_concurrent_rollouts=max_concurrent_rollouts,
        ),
    )
    raise typer.Exit(launch.run(sc.load_config(GROUP, ctx), opts))


@app.command()
def register(
    ctx: typer.Context,
    model_name: Annotated[str, typer.Option("--model-name", help="Name clients use as 'model'.")],
    service: Service = None,
    backend: Backend = None,
    model_path: ModelPath = None,
    tokenizer_path: TokenizerPath = None,
    engine_args: EngineArgs = None,
    proxy_args: ProxyArgs = None,
    model_health_timeout: ModelHealthTimeout = None,
    max_staleness: MaxStaleness = None,
    batch_size: BatchSize = None,
    max_concurrent_rollouts: MaxConcurrentRollouts = None,
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
        max_staleness=max_staleness,
        batch_size=batch_size,
        max_concurrent_rollouts=max_concurrent_rollouts,
    )
    from areal_cli.inf import registration

    raise typer.Exit(registration.register(sc.load_config(GROUP, ctx), service, opts))


@app.command()
def deregister(
    ctx: typer.Context,
    model_name: Annotated[str, typer.Option("--model-name", help="The model to remove.")],
    service: Service = None,
    replica: Annotated[
        int | None,
        typer.Option(
            "--replica",
            min=0,
            help="Drain and stop only this replica (its rank) of the model: a scale-down.",
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            "--drain-timeout",
            min=0,
            help="With --replica: seconds the requests on its engine may take to finish "
            "before they move to another replica.",
        ),
    ] = 30.0,
) -> None:
    """Remove a model from the gateway, then stop its data proxies and engines; with
    --replica, drain one replica and stop its engine."""
    cfg = sc.load_config(GROUP, ctx)
    if replica is not None:
        from areal_cli.inf import drain

        raise typer.Exit(drain.deregister_replica(cfg, service, model_name, replica, drain_timeout))
    from areal_cli.inf import registration

    raise typer.Exit(registration.deregister(cfg, service, model_name))


@app.command()
def models(ctx: typer.Context, service: Service = None, as_json: Json = False) -> None:
    """List the models of a service (the gateway's registry merged with local state)."""
    from areal_cli.inf import registration

    raise typer.Exit(registration.models(sc.load_config(GROUP, ctx), service, as_json))


@app.command()
def trace(
    ctx: typer.Context,
    session: Annotated[
        str | None, typer.Option("--session", help="The RL session to show.")
    ] = None,
    group: Annotated[
        str | None, typer.Option("--group", help="Or a group: each of its sessions.")
    ] = None,
    service: Service = None,
    gateway_url: Annotated[
        str | None,
        typer.Option(
            "--gateway-url",
            help="Read from this gateway instead of a service of this machine (admin key from "
            "--admin-api-key or AREAL_ADMIN_API_KEY).",
        ),
    ] = None,
    admin_api_key: Annotated[
        str | None,
        typer.Option(
            envvar="AREAL_ADMIN_API_KEY",
            show_envvar=True,
            help="With --gateway-url: the gateway's admin key.",
        ),
    ] = None,
    tokenizer_path: Annotated[
        str | None,
        typer.Option(
            help="Tokenizer folder to decode token pieces with [default: the model's, from "
            "the service's state]."
        ),
    ] = None,
    as_json: Json = False,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Write one self-contained page (mode 0600) to this file instead of the "
            "terminal view.",
        ),
    ] = None,
) -> None:
    """Show a session's (or group's) interactions token by token: mask, logprobs, versions,
    rewards, finish reasons. Reads the gateway; removes nothing."""
    from areal_cli.inf import trace as tr

    opts = tr.TraceOptions(
        service=service,
        gateway_url=gateway_url,
        admin_api_key=admin_api_key,
        session=session,
        group=group,
        tokenizer_path=tokenizer_path,
        as_json=as_json,
        html=html,
    )
    default = sc.load_config(GROUP, ctx).get("default", "service") or "default"
    raise typer.Exit(tr.trace(opts, default))


sc.add_lifecycle_commands(
    app,
    GROUP,
    service_help=SERVICE_HELP,
    ps_help="List inference services on this machine.",
    status_help="Per-component state of one service (gateway, router, workers, data proxies).",
    component_help="gateway, router, <model>-worker-<i>, <model>-data-proxy-<i>.",
    stop_help="Stop every component (proxies, engines, gateway, router) and remove the state.",
)
