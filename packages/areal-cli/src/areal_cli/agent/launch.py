"""`areal agent run`: assemble a local agent service and leave it running.

Assembly: router -> gateway (`--mode agent --router-addr`) -> per pair i the agent
worker `worker-<i>` (`areal-agent-worker --agent pkg.module.Class`, with the
caller's working directory first on PYTHONPATH so a package beside the caller
imports), then its data proxy `proxy-<i>` (`areal-agent-proxy
--worker-addr <worker>`) -> `POST /admin/pairs {"proxy_id", "address"}` on the
gateway for each pair -> wait until every component is healthy. Then `run`
returns and the service keeps running.

With `--scheduler ray` the router and gateway still run here (on the CLI's node) and
the pairs go to the cluster: one placement-group bundle and one detached host actor per
pair (agent/ray_units.py), each pair's worker on its node's loopback and its proxy on
the node's address, the service's internal gRPC under mutual TLS.

Every process shares one random AREAL_INTERNAL_TOKEN; the gateway gets
AREAL_ADMIN_API_KEY and linked proxies AREAL_PROXY_INF_ADMIN_API_KEY, all only
through the environment. A launch that fails stops everything it started and
leaves no state.
"""

from __future__ import annotations

import copy
import os
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from areal_cli import state as st
from areal_cli import supervisor
from areal_cli.components import Component, LaunchError
from areal_cli.config import Config
from areal_cli.errors import CLIError
from areal_cli.http import call, error_message, gateway_healthy
from areal_cli.launcher import (
    Launcher,
    check_gateways,
    check_log_level,
    progress,
    resolve_binary,
    self_identity,
    start_router_gateway,
)
from areal_cli.policy import policy_from_config
from areal_cli.reconcile import components, gateway_alive
from areal_cli.service_run import run_service

GROUP = "agent"
ROUTING_STRATEGIES = (
    "session_affinity",
    "least_loaded",
    "round_robin",
    "power_of_two",
    "cache_aware",
)
# Built-in defaults (docs/cli.md's example agent config shows the same values).
DEFAULT_NUM_PAIRS = 1
DEFAULT_SETUP_TIMEOUT = 120.0
DEFAULT_HEALTH_POLL_INTERVAL = 5.0
DEFAULT_DRAIN_TIMEOUT = 30.0
DEFAULT_SESSION_TIMEOUT = 1800.0
DEFAULT_PORT = 0  # the OS picks; `status --json | jq -r .gateway.url` tells where
DEFAULT_ROUTING = "session_affinity"  # new sessions by load, then sticky to their pair
SCHEDULERS = ("local", "ray")
# Exit code of areal-agent-worker for a bad --agent (its one-line message is the last log line).
WORKER_USAGE_EXIT = 2

_AGENT_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")


@dataclass
class RunOptions:
    """Flags as given (None = not given); resolved against the config by `resolve`."""

    service: str | None = None
    agent: str | None = None
    num_pairs: int | None = None
    admin_api_key: str | None = None
    force: bool = False
    setup_timeout: float | None = None
    health_poll_interval: float | None = None
    drain_timeout: float | None = None
    session_timeout: float | None = None
    log_level: str | None = None
    host: str | None = None
    port: int | None = None
    gateways: int | None = None
    routing_strategy: str | None = None
    inf_service: str | None = None
    inf_gateway_url: str | None = None
    inf_admin_api_key: str | None = None
    inf_model: str | None = None
    supervise: bool | None = None
    scheduler: str | None = None
    ray_address: str | None = None


@dataclass
class InfLink:
    """The inference service whose gateway records the agent's LLM calls."""

    gateway_url: str
    admin_api_key: str
    model: str
    service: str = ""  # set when linked by --inf-service


@dataclass
class Plan:
    """Everything `run` needs, resolved and checked before any process starts."""

    service: str
    agent: str
    num_pairs: int
    admin_api_key: str
    key_source: str
    force: bool
    setup_timeout: float
    health_poll_interval: float
    drain_timeout: float
    session_timeout: float
    log_level: str
    host: str
    port: int
    routing_strategy: str
    inf: InfLink | None
    gateways: int = 1
    supervision: dict[str, Any] | None = None
    scheduler: str = "local"
    ray_address: str | None = None  # the flag; with ray, run() resolves it into `ray`
    # --scheduler ray: what is pinned into the state as "ray" (set by run(): [scheduler]
    # settings, the device resource and the CLI's node, which only the cluster can tell).
    ray: dict[str, Any] | None = None


def _positive(name: str, value: float) -> float:
    if value <= 0:
        raise CLIError(f"{name} must be positive (got {value:g})", code=2)
    return value


def resolve(cfg: Config, o: RunOptions) -> Plan:
    """flag > --config > $AREAL_HOME/agent/config.toml > built-in, with every value checked."""
    service = st.check_name("service", cfg.pick(o.service, "default", "service", "default"))
    agent = cfg.pick(o.agent, "run", "agent")
    if not agent:
        raise CLIError("--agent is required", code=2)
    if not _AGENT_PATH.match(agent):
        raise CLIError(
            f"invalid --agent '{agent}': use the import path package.module.Class", code=2
        )
    num_pairs = int(cfg.pick(o.num_pairs, "run", "num_pairs", DEFAULT_NUM_PAIRS))
    if num_pairs < 1:
        raise CLIError(f"--num-pairs must be at least 1 (got {num_pairs})", code=2)
    setup_timeout = _positive(
        "--setup-timeout",
        float(cfg.pick(o.setup_timeout, "run", "setup_timeout", DEFAULT_SETUP_TIMEOUT)),
    )
    poll = _positive(
        "--health-poll-interval",
        float(
            cfg.pick(
                o.health_poll_interval,
                "run",
                "health_poll_interval",
                DEFAULT_HEALTH_POLL_INTERVAL,
            )
        ),
    )
    drain = float(cfg.pick(o.drain_timeout, "run", "drain_timeout", DEFAULT_DRAIN_TIMEOUT))
    if drain < 0:
        raise CLIError(f"--drain-timeout must not be negative (got {drain:g})", code=2)
    session_timeout = _positive(
        "--session-timeout",
        float(cfg.pick(o.session_timeout, "run", "session_timeout", DEFAULT_SESSION_TIMEOUT)),
    )
    log_level = check_log_level(cfg.pick(o.log_level, "default", "log_level", "info"))
    host = cfg.pick(o.host, "run", "gateway_host", "127.0.0.1")
    port = int(cfg.pick(o.port, "run", "gateway_port", DEFAULT_PORT))
    if not 0 <= port <= 65535:
        raise CLIError(f"--port {port} is out of range", code=2)
    gateways = check_gateways(int(cfg.pick(o.gateways, "run", "gateways", 1)))
    strategy = cfg.pick(o.routing_strategy, "run", "routing_strategy", DEFAULT_ROUTING)
    if strategy not in ROUTING_STRATEGIES:
        raise CLIError(
            f"invalid --routing-strategy '{strategy}' (choose from {', '.join(ROUTING_STRATEGIES)})",
            code=2,
        )
    scheduler = cfg.pick(o.scheduler, "scheduler", "type", "local")
    if scheduler not in SCHEDULERS:
        raise CLIError(
            f"invalid --scheduler '{scheduler}' (choose from {', '.join(SCHEDULERS)})", code=2
        )
    if o.ray_address and scheduler != "ray":
        raise CLIError("--ray-address needs --scheduler ray", code=2)
    key = o.admin_api_key or cfg.get("default", "admin_api_key")
    key_source = "given"
    if not key and o.force:
        key, key_source = st.recorded_admin_key(GROUP, service), "kept"
    if not key:
        key, key_source = "areal-agent-" + secrets.token_urlsafe(24), "generated"
    return Plan(
        service=service,
        agent=agent,
        num_pairs=num_pairs,
        admin_api_key=key,
        key_source=key_source,
        force=o.force,
        setup_timeout=setup_timeout,
        health_poll_interval=poll,
        drain_timeout=drain,
        session_timeout=session_timeout,
        log_level=log_level,
        host=host,
        port=port,
        routing_strategy=strategy,
        inf=resolve_inf_link(cfg, o),
        gateways=gateways,
        supervision=policy_from_config(cfg, o.supervise).to_dict(),
        scheduler=scheduler,
        ray_address=o.ray_address,
    )


def resolve_inf_link(cfg: Config, o: RunOptions) -> InfLink | None:
    """`--inf-service NAME` (read from its state), or `--inf-gateway-url` + `--inf-admin-api-key`."""
    inf_service = cfg.pick(o.inf_service, "run", "inf_service")
    url = cfg.pick(o.inf_gateway_url, "run", "inf_gateway_url")
    key = o.inf_admin_api_key or cfg.get("run", "inf_admin_api_key")
    model = cfg.pick(o.inf_model, "run", "inf_model", "")
    if inf_service and url:
        raise CLIError("give either --inf-service or --inf-gateway-url, not both", code=2)
    if inf_service:
        if o.inf_admin_api_key:
            raise CLIError(
                "--inf-admin-api-key goes with --inf-gateway-url; --inf-service reads the key "
                "from that service's secrets",
                code=2,
            )
        return _link_inf_service(st.check_name("service", inf_service), model)
    if url:
        if not re.match(r"^https?://[^/\s]+", url):
            raise CLIError(f"invalid --inf-gateway-url '{url}': expected http(s)://host:port", 2)
        if not key:
            raise CLIError("--inf-gateway-url needs --inf-admin-api-key", code=2)
        return InfLink(url.rstrip("/"), key, model)
    if o.inf_admin_api_key or o.inf_model:
        raise CLIError(
            "--inf-admin-api-key / --inf-model need --inf-service or --inf-gateway-url", code=2
        )
    return None


def _link_inf_service(name: str, model: str) -> InfLink:

    s = st.load("inf", name)
    if s is None:
        known = st.list_services("inf")
        hint = f" (known: {', '.join(known)})" if known else " (no inf services are recorded)"
        raise CLIError(f"--inf-service: no inf service named '{name}'{hint}")
    url = (s.get("gateway") or {}).get("url", "")
    if not gateway_alive(s) or not url:
        raise CLIError(
            f"--inf-service: inf service '{name}' is not running (its gateway is dead); "
            f"start it with `areal inf run --service {name} --detach`"
        )
    key = st.load_secrets("inf", name).get("admin_api_key")
    if not key:
        raise CLIError(
            f"--inf-service: no admin key recorded for inf service '{name}' "
            f"({st.secrets_path('inf', name)} is missing)"
        )
    if not model:
        models = sorted(s.get("models") or {})
        model = models[0] if len(models) == 1 else ""
    return InfLink(url, key, model, service=name)


# ------------------------------------------------------------------- run


def run(cfg: Config, o: RunOptions) -> int:
    plan = resolve(cfg, o)
    router_bin = resolve_binary(cfg, "router")
    gateway_bin = resolve_binary(cfg, "gateway")
    proxy_bin = resolve_binary(cfg, "proxy")
    worker_bin = resolve_binary(cfg, "agent_worker")
    if plan.inf is not None and not supervisor.http_ok(plan.inf.gateway_url + "/health", 3.0):
        raise CLIError(f"inference gateway {plan.inf.gateway_url} does not answer GET /health")
    if plan.scheduler == "ray":
        from areal_cli.cluster import ray_scheduler

        settings = ray_scheduler.scheduler_settings(cfg, plan.ray_address)
        # A cluster that is not there fails the command now; the device resource is pinned.
        ray = ray_scheduler.connect(settings["ray_address"])
        # An agent pair runs the user's agent code and a proxy, not an engine: one CPU each
        # unless [scheduler] device_resource says otherwise (never a GPU by default).
        settings["device_resource"] = settings["device_resource"] or "CPU"
        settings["driver_node"] = ray.util.get_node_ip_address()
        settings["gcs_address"] = ray.get_runtime_context().gcs_address
        ray_scheduler.check_gateway_nodes(ray, settings)
        plan.ray = settings

    def start(launcher: Launcher) -> None:
        deadline = launcher.began + plan.setup_timeout
        if plan.ray is not None:
            from areal_cli.cluster import ray_scheduler

            ray_scheduler.setup_tls(launcher)
        start_router_gateway(
            launcher,
            router_bin=router_bin,
            gateway_bin=gateway_bin,
            host=plan.host,
            port=plan.port,
            admin_api_key=plan.admin_api_key,
            policy=plan.routing_strategy,
            common_args=_common_args(plan),
            gateway_args=["--mode", "agent"],
            timeout=lambda: _left(deadline),
            # Gateways on other nodes reach the router at this node's address (over the
            # service's mutual TLS); otherwise it stays on loopback.
            router_host=(plan.ray or {}).get("driver_node", "127.0.0.1")
            if (plan.ray or {}).get("gateway_nodes")
            else "127.0.0.1",
            gateways=plan.gateways,
        )
        if plan.ray is not None:
            from areal_cli.agent.ray_units import start_pairs_ray

            start_pairs_ray(launcher, plan, worker_bin, proxy_bin, deadline)
        else:
            _start_pairs(launcher, plan, worker_bin, proxy_bin, deadline)
        progress(f"{plan.num_pairs} pair(s) started and registered ({launcher.elapsed():.1f}s)")
        _wait_healthy(launcher, plan, deadline)

    return run_service(
        GROUP,
        plan.service,
        force=plan.force,
        host=plan.host,
        port=plan.port,
        port_setting="[run] gateway_port",
        admin_api_key=plan.admin_api_key,
        extra_secrets=None if plan.inf is None else {"inf_admin_api_key": plan.inf.admin_api_key},
        new_state=lambda: _initial_state(plan),
        start=start,
        # Always detached: an agent service has no foreground mode.
        detach=True,
        supervise=bool((plan.supervision or {}).get("enabled")),
        summary=lambda launcher: _print_summary(plan, launcher.state, launcher.elapsed()),
    )


def _initial_state(plan: Plan) -> dict[str, Any]:
    inf = None
    if plan.inf is not None:
        inf = {
            "service": plan.inf.service,
            "gateway_url": plan.inf.gateway_url,
            "model": plan.inf.model,
        }
    return {
        "version": 1,
        "group": GROUP,
        "service": plan.service,
        "instance": uuid.uuid4().hex,
        "phase": "starting",
        "scheduler": plan.scheduler,
        **({"ray": plan.ray} if plan.ray is not None else {}),
        "created_at": time.time(),
        "owner": self_identity(foreground=False),
        "agent": plan.agent,
        "num_pairs": plan.num_pairs,
        "cwd": os.getcwd(),
        "routing_strategy": plan.routing_strategy,
        "gateways": plan.gateways,
        "log_level": plan.log_level,
        "setup_timeout": plan.setup_timeout,
        "health_poll_interval": plan.health_poll_interval,
        "drain_timeout": plan.drain_timeout,
        "session_timeout": plan.session_timeout,
        "admin_key_source": plan.key_source,
        "supervision": plan.supervision or {"enabled": False},
        "inf_link": inf,
        "gateway": {"host": plan.host, "port": plan.port, "url": ""},
        "router": {"address": ""},
        "components": {},
        "pairs": [],
    }


def _common_args(plan: Plan) -> list[str]:
    """Arguments every component of the service takes."""
    return ["--log-level", plan.log_level, "--drain-timeout", f"{plan.drain_timeout:g}"]


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def worker_env(base: dict[str, str], cwd: str) -> dict[str, str]:
    """The worker's environment: the caller's cwd first on PYTHONPATH (`my_package.x.Y` imports)."""
    old = os.environ.get("PYTHONPATH", "")
    parts = [cwd] + [p for p in old.split(os.pathsep) if p and p != cwd]
    return {**base, "PYTHONPATH": os.pathsep.join(parts)}


def _start_pairs(
    launcher: Launcher, plan: Plan, worker_bin: str, proxy_bin: str, deadline: float
) -> None:
    """Workers in parallel, then their proxies in parallel, then register every pair."""
    state = launcher.state
    common = _common_args(plan)
    wenv = worker_env(launcher.env, state["cwd"])
    waits, winfos = [], []
    for i in range(plan.num_pairs):
        pair: dict[str, Any] = {
            "index": i,
            "worker": f"worker-{i}",
            "proxy": f"proxy-{i}",
            "proxy_id": f"proxy-{i}",
        }
        state["pairs"].append(pair)
        ready = launcher.ready_file(pair["worker"])
        argv = [worker_bin, "--agent", plan.agent, "--host", "127.0.0.1", "--port", "0"]
        argv += ["--ready-file", str(ready), *common]
        proc, comp = launcher.spawn(
            pair["worker"], "worker", argv, env=wenv, host="127.0.0.1", meta={"rank": i}
        )
        info: dict[str, Any] = {}
        winfos.append((pair, comp, info))
        waits.append((proc, comp, Launcher.ready_check(ready, proc.pid, info)))
    launcher.save()
    _wait_workers(launcher, waits, deadline)
    for pair, comp, info in winfos:
        address = f"{info.get('host') or '127.0.0.1'}:{info['port']}"
        pair["worker_address"] = address
        launcher.update(comp, port=int(info["port"]), address=address)
    launcher.save()

    link_env, link = inf_link(plan)
    penv = {**launcher.env, **link_env}
    waits, pinfos = [], []
    for pair in state["pairs"]:
        ready = launcher.ready_file(pair["proxy"])
        argv = [proxy_bin, "--host", "127.0.0.1", "--port", "0"]
        argv += ["--ready-file", str(ready), *common]
        argv += ["--worker-addr", pair["worker_address"], "--proxy-id", pair["proxy_id"]]
        argv += ["--session-timeout", f"{plan.session_timeout:g}", *link]
        proc, comp = launcher.spawn(
            pair["proxy"],
            "proxy",
            argv,
            env=penv,
            host="127.0.0.1",
            meta={"rank": pair["index"], "proxy_id": pair["proxy_id"]},
        )
        info = {}
        pinfos.append((pair, comp, info))
        waits.append((proc, comp, Launcher.ready_check(ready, proc.pid, info)))
    launcher.wait_all(waits, _left(deadline))
    for pair, comp, info in pinfos:
        address = f"{info.get('host') or '127.0.0.1'}:{info['port']}"
        pair["address"] = address
        launcher.update(comp, port=int(info["port"]), address=address)
    launcher.save()
    url = state["gateway"]["url"]
    for pair in state["pairs"]:
        register_pair(url, plan.admin_api_key, pair["proxy_id"], pair["address"])
        pair["registered"] = True
    launcher.save()


def inf_link(plan: Plan) -> tuple[dict[str, str], list[str]]:
    """What an agent proxy needs to reach a linked inference service: its environment (the
    inference admin key, never argv) and its flags; nothing without `--inf-service`."""
    if plan.inf is None:
        return {}, []
    link = ["--inf-gateway-url", plan.inf.gateway_url]
    if plan.inf.model:
        link += ["--inf-model", plan.inf.model]
    return {"AREAL_PROXY_INF_ADMIN_API_KEY": plan.inf.admin_api_key}, link


def _wait_workers(launcher: Launcher, waits: list, deadline: float) -> None:
    """Like wait_all, but a worker that exits 2 (bad --agent) fails with its own one-line message."""
    try:
        launcher.wait_all(waits, _left(deadline))
    except LaunchError as e:
        procs = {comp.name: proc for proc, comp, _ in waits}
        proc = procs.get(e.component)
        if proc is not None and proc.returncode == WORKER_USAGE_EXIT:
            line = _last_line(e.log)
            raise CLIError(
                f"{e.component} could not load the agent: {line or 'exit code 2'}"
            ) from None
        raise


def _last_line(log: Any) -> str:
    text = supervisor.log_tail(log, 5)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("--- ")]
    return lines[-1] if lines else ""


def register_pair(gateway_url: str, key: str, proxy_id: str, address: str) -> None:
    body = {"proxy_id": proxy_id, "address": address}
    status, payload = call("POST", gateway_url + "/admin/pairs", key=key, body=body, timeout=30)
    if status not in (200, 201):
        raise CLIError(
            f"gateway refused to register pair {proxy_id} ({address}): HTTP {status}: "
            f"{error_message(payload)}"
        )


def pair_health(gateway_url: str, key: str, proxy_ids: list[str]) -> dict[str, str] | None:
    """Health of each pair as the router sees it (`GET /admin/workers`); None if not offered."""
    try:
        status, payload = call("GET", gateway_url + "/admin/workers", key=key, timeout=5)
    except CLIError:
        return {p: "gateway not answering" for p in proxy_ids}
    if status != 200 or not isinstance(payload, dict):
        return None
    workers = payload.get("workers")
    if not isinstance(workers, list):
        return None
    seen = {
        str(w.get("proxy_id")): str(w.get("health", "unknown")).lower()
        for w in workers
        if isinstance(w, dict)
    }
    return {p: seen.get(p, "not registered") for p in proxy_ids}


def _wait_healthy(launcher: Launcher, plan: Plan, deadline: float) -> None:
    """Poll every --health-poll-interval until every component is healthy (or fail)."""

    state = launcher.state
    url = state["gateway"]["url"]
    ids = [p["proxy_id"] for p in state["pairs"]]
    while True:
        # On a cluster the hosts' answers fill in a copy (the state records the launch).
        comps = components(copy.deepcopy(state) if plan.ray is not None else state)
        for p in launcher.procs.values():
            p.poll()
        # A pair on a cluster whose host is restarting it (or not answering) may come back
        # before the deadline; only one its host gave up on fails the launch at once.
        away = [c for c in comps.values() if c.remote and not c.alive()]
        failed = [c for c in away if (c.meta.get("supervision") or {}).get("state") == "failed"]
        if failed:
            c = failed[0]
            why = ((c.meta.get("supervision") or {}).get("last_failure") or {}).get("reason")
            raise CLIError(
                f"{c.name} on node {c.meta.get('node', '?')} failed ({why or 'gave up'}); see "
                f"`areal agent logs --service {plan.service} --component {c.name}`"
            )
        dead = [c for c in comps.values() if not c.remote and not c.alive()]
        if dead:
            c = dead[0]
            proc = launcher.procs.get(c.pid)
            code = proc.returncode if proc is not None else None
            raise LaunchError(c.name, f"process exited (code {code})", _path(c.log))
        problem = ""
        gw = comps["gateway"]
        if away:
            problem = ", ".join(c.name for c in away) + " not running on its node"
        elif not gateway_healthy(url, gw.pid):
            problem = "gateway does not answer GET /health"
        else:
            health = pair_health(url, plan.admin_api_key, ids)
            if health is not None:
                bad = {p: h for p, h in health.items() if h != "healthy"}
                if bad:
                    problem = "router sees " + ", ".join(f"{p} {h}" for p, h in bad.items())
        if not problem:
            return
        if time.monotonic() >= deadline:
            raise CLIError(
                f"agent service not healthy after --setup-timeout {plan.setup_timeout:g}s: "
                f"{problem}"
            )
        time.sleep(min(plan.health_poll_interval, _left(deadline)))


def _path(p: str):
    from pathlib import Path

    return Path(p)


def _print_summary(plan: Plan, state: dict[str, Any], took: float) -> None:
    service = plan.service
    print(f"agent service '{service}' is running ({took:.1f}s)")
    print(f"  gateway    {state['gateway']['url']}")
    print(f"  agent      {plan.agent} ({plan.num_pairs} pair(s))")
    if plan.inf is not None:
        via = f"inf service '{plan.inf.service}', " if plan.inf.service else ""
        model = f", model {plan.inf.model}" if plan.inf.model else ""
        print(f"  inference  {via}{plan.inf.gateway_url}{model}")
    if plan.key_source in ("generated", "kept"):
        where = st.secrets_path(GROUP, service)
        how = "generated" if plan.key_source == "generated" else "kept from the replaced service"
        print(f"  admin key  {how}; stored in {where} (mode 0600)")
    print(f"  status     areal agent status --service {service}")
    print(f"  stop       areal agent stop --service {service}", flush=True)


__all__ = ["Component", "RunOptions", "resolve", "run"]
