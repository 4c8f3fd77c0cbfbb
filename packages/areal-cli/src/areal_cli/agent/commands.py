"""`areal agent` commands: thin typer wrappers; the work is imported lazily.

`run` is in agent/launch.py; ps / status / logs / stop are the shared lifecycle
(components `gateway`, `router`, `worker-<i>`, `proxy-<i>`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from areal_cli import service_commands as sc
from areal_cli.service_commands import AdminApiKey, Force, Host, LogLevel, Supervise

GROUP = "agent"
SERVICE_HELP = "Service name [default: 'default']."

app = sc.group_app(
    help="Manage local agent services (gateway, router, worker/data-proxy pairs).",
    config_help="Extra TOML config, over $AREAL_HOME/agent/config.toml.",
)

Service = Annotated[str | None, typer.Option("--service", help=SERVICE_HELP)]


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
    admin_api_key: AdminApiKey = None,
    force: Force = False,
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
    log_level: LogLevel = None,
    host: Host = None,
    port: Annotated[
        int | None, typer.Option(help="Gateway port [default: 0 = the OS picks; see status].")
    ] = None,
    gateways: sc.Gateways = None,
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
    supervise: Supervise = None,
    scheduler: Annotated[
        str | None,
        typer.Option(
            help="Where the pairs run: 'local' (this machine) or 'ray' (an existing Ray cluster "
            "this node belongs to, one pair per bundle; needs areal-cli[ray]; the agent code "
            "must be at the same path, or installed, on every node) [default: local]."
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="With --scheduler ray: the cluster's HOST:PORT, or 'auto' for the one this "
            "node runs [default: [scheduler] address, $RAY_ADDRESS, auto]."
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
        gateways=gateways,
        routing_strategy=routing_strategy,
        inf_service=inf_service,
        inf_gateway_url=inf_gateway_url,
        inf_admin_api_key=inf_admin_api_key,
        inf_model=inf_model,
        supervise=supervise,
        scheduler=scheduler,
        ray_address=ray_address,
    )
    raise typer.Exit(launch.run(sc.load_config(GROUP, ctx), opts))


sc.add_lifecycle_commands(
    app,
    GROUP,
    service_help=SERVICE_HELP,
    ps_help="List agent services on this machine.",
    status_help="Per-component state: gateway, router and each pair's worker + proxy.",
    component_help="gateway, router, worker-<i>, proxy-<i>.",
    stop_help="Stop every component and remove the state.",
)
