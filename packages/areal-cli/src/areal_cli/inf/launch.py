"""`areal inf run`, `register`, `deregister`: assemble and change an inference service.

Assembly (docs/services.md): router -> gateway (--router-addr) -> per replica an
engine, then its data proxy (--engine-url) once the engine is healthy -> register
the proxies with the gateway admin API. Every process shares one random
AREAL_INTERNAL_TOKEN; the gateway also gets AREAL_ADMIN_API_KEY; both only via
the environment.
"""

from __future__ import annotations

import secrets
import shlex
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_cli import admission, engines, loopback, supervisor
from areal_cli import backend as bk
from areal_cli import state as st
from areal_cli.config import Config
from areal_cli.errors import CLIError
from areal_cli.http import call, error_message
from areal_cli.launcher import (
    Launcher,
    check_gateways,
    check_log_level,
    progress,
    resolve_binary,
    self_identity,
    start_router_gateway,
)
from areal_cli.models import resolve_short_name
from areal_cli.policy import policy_from_config
from areal_cli.private_files import make_dir
from areal_cli.service_run import run_service

GROUP = "inf"
SCHEDULERS = ("local", "ray")
ROUTING_STRATEGIES = (
    "round_robin",
    "least_loaded",
    "power_of_two",
    "session_affinity",
    "cache_aware",
)
DEFAULT_PORT = 8080
DEFAULT_LAUNCH_TIMEOUT = 30.0
DEFAULT_MODEL_HEALTH_TIMEOUT = 600.0


@dataclass
class ModelOptions:
    """Model flags as given (None = not given); resolved against [register.internal]."""

    name: str | None = None
    backend: str | None = None
    model_path: str | None = None
    tokenizer_path: str | None = None
    engine_args: str | None = None
    proxy_args: str | None = None
    health_timeout: float | None = None
    # Admission bounds (areal_cli.admission): None = not given.
    max_staleness: int | None = None
    batch_size: int | None = None
    max_concurrent_rollouts: int | None = None

    def given(self) -> list[str]:
        flags = {
            "backend": "--backend",
            "model_path": "--model-path",
            "tokenizer_path": "--tokenizer-path",
            "engine_args": "--engine-args",
            "proxy_args": "--proxy-args",
            "health_timeout": "--model-health-timeout",
            "max_staleness": "--max-staleness",
            "batch_size": "--batch-size",
            "max_concurrent_rollouts": "--max-concurrent-rollouts",
        }
        return [f for k, f in flags.items() if getattr(self, k) is not None]


@dataclass
class ModelSpec:
    name: str
    backend: bk.Backend
    model_path: str
    tokenizer_path: str
    engine_args: str
    proxy_args: str
    health_timeout: float
    python: str
    default_args: str
    # Admission bounds to set once registered ({}: none, every start admitted).
    admission: dict[str, int] = field(default_factory=dict)


def resolve_model(cfg: Config, opts: ModelOptions, name_flag: str) -> ModelSpec:
    """Flags > [register.internal] > built-ins; engine location and default args from [engine.*]."""
    name = opts.name
    if not name:
        raise CLIError(f"{name_flag} is required", code=2)
    st.check_name("model", name)
    spec = cfg.pick(opts.backend, "register.internal", "backend", "sglang:d1")
    backend = bk.parse(spec)
    bk.check_local(backend)
    model_path = cfg.pick(opts.model_path, "register.internal", "model_path")
    if not model_path:
        raise CLIError(f"--model-path is required to register model '{name}'", code=2)
    model_path = resolve_short_name(model_path) or _abs_if_local(model_path)
    tokenizer = _abs_if_local(
        cfg.pick(opts.tokenizer_path, "register.internal", "tokenizer_path", model_path)
    )
    timeout = float(
        cfg.pick(
            opts.health_timeout,
            "register.internal",
            "model_health_timeout",
            DEFAULT_MODEL_HEALTH_TIMEOUT,
        )
    )
    if timeout <= 0:
        raise CLIError("--model-health-timeout must be positive", code=2)
    engine_args = cfg.pick(opts.engine_args, "register.internal", "engine_args", "")
    proxy_args = cfg.pick(opts.proxy_args, "register.internal", "proxy_args", "")
    for flag, value in (("--engine-args", engine_args), ("--proxy-args", proxy_args)):
        try:
            shlex.split(value)
        except ValueError as e:
            raise CLIError(f"cannot split {flag} {value!r}: {e}", code=2) from None
    engines.check_engine_args(backend.engine, shlex.split(engine_args))
    table = f"engine.{backend.engine}"
    python = engines.resolve_python(backend.engine, cfg.get(table, "python"))
    default_args = cfg.get(table, "default_args")
    bounds = admission.resolve(
        cfg,
        {
            "max_staleness": opts.max_staleness,
            "batch_size": opts.batch_size,
            "max_concurrent_rollouts": opts.max_concurrent_rollouts,
        },
    )
    return ModelSpec(
        name,
        backend,
        model_path,
        tokenizer,
        engine_args,
        proxy_args,
        timeout,
        python,
        default_args,
        bounds,
    )


def _abs_if_local(path: str) -> str:
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def _default_engine_args(spec: ModelSpec, on_gpu: bool) -> str:
    if spec.default_args is not None:
        return spec.default_args
    if on_gpu:
        return ""
    return engines.SGLANG_CPU_ARGS if spec.backend.engine == "sglang" else engines.VLLM_CPU_ARGS


def start_model(launcher: Launcher, spec: ModelSpec, proxy_bin: str, opts: dict[str, Any]) -> dict:
    """Start every replica of `spec` (engines in parallel, then proxies); its state record."""
    if launcher.state.get("scheduler") == "ray":
        from areal_cli.inf.ray_units import start_model_ray

        # The cluster's nodes say whether they have GPUs; the CPU flags unless they do.
        on_gpu = launcher.state["ray"].get("device_resource") == "GPU"
        defaults = shlex.split(_default_engine_args(spec, on_gpu))
        return start_model_ray(launcher, spec, proxy_bin, opts, defaults)
    devices = bk.visible_gpus()
    others = [s for n, s in st.load_all(GROUP).items() if n != launcher.service]
    others += list(st.load_all("agent").values())
    used = bk.used_gpus([*others, launcher.state])
    alloc = bk.allocate(spec.backend, devices, used)
    engine_name = spec.backend.engine
    where = f"GPUs {alloc}" if devices else "the CPU"
    progress(f"starting {spec.backend.dp} {engine_name} replica(s) of '{spec.name}' on {where}")
    record: dict[str, Any] = {
        "name": spec.name,
        "kind": "internal",
        "backend": str(spec.backend),
        "engine": engine_name,
        "model_path": spec.model_path,
        "tokenizer_path": spec.tokenizer_path,
        "engine_args": spec.engine_args,
        "proxy_args": spec.proxy_args,
        "phase": "starting",
        "replicas": [],
    }
    launcher.state.setdefault("models", {})[spec.name] = record
    defaults = shlex.split(_default_engine_args(spec, bool(devices)))
    user_args = shlex.split(spec.engine_args)
    preload, why_not = loopback.shim()
    if preload is None:
        progress(f"  warning: {why_not}; the engine may listen on a wildcard address")
    waits = []
    for rank, gpus in enumerate(alloc):
        port = _engine_port()
        launch = engines.engine_launch(
            engine_name,
            python=spec.python,
            model_path=spec.model_path,
            served_name=spec.name,
            host="127.0.0.1",
            port=port,
            tokenizer_path=spec.tokenizer_path if spec.tokenizer_path != spec.model_path else None,
            extra_args=defaults,
            user_args=user_args,
            tensor_parallel=spec.backend.tp,
            gpus=gpus,
        )
        url = f"http://127.0.0.1:{port}"
        name = f"{spec.name}-worker-{rank}"
        record["replicas"].append(
            {
                "rank": rank,
                "gpus": gpus,
                "worker": name,
                "data_proxy": f"{spec.name}-data-proxy-{rank}",
                "engine_url": url,
            }
        )
        proc, comp = launcher.spawn(
            name,
            "engine",
            launch.argv,
            env=loopback.with_preload(launch.env, preload) if preload else launch.env,
            host="127.0.0.1",
            port=port,
            meta={"model": spec.name, "rank": rank, "url": url, "gpus": gpus},
        )
        waits.append((proc, comp, _http_check(url + launch.health_path)))
    t0 = time.monotonic()
    launcher.wait_all(waits, spec.health_timeout, "healthy")
    progress(f"  engines healthy after {time.monotonic() - t0:.1f}s")
    pwaits, infos = [], []
    for rep in record["replicas"]:
        name = rep["data_proxy"]
        ready = launcher.ready_file(name)
        argv = [
            proxy_bin,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--log-level",
            opts["log_level"],
            "--engine-url",
            rep["engine_url"],
            "--engine",
            engine_name,
            "--model",
            spec.name,
            "--tokenizer-path",
            spec.tokenizer_path,
            "--proxy-id",
            name,
            # Stable per service and proxy: a restarted proxy finds its recorded sessions.
            "--db-path",
            str(proxy_db_path(launcher.service, name)),
            *router_addr_args(launcher),
            *shlex.split(spec.proxy_args),
        ]
        proc, comp = launcher.spawn(
            name,
            "proxy",
            argv,
            env=launcher.env,
            host="127.0.0.1",
            meta={"model": spec.name, "rank": rep["rank"], "proxy_id": name},
        )
        info: dict[str, Any] = {}
        infos.append((rep, comp, info))
        pwaits.append((proc, comp, Launcher.ready_check(ready, proc.pid, info)))
    launcher.wait_all(pwaits, opts["launch_timeout"])
    for rep, comp, info in infos:
        address = f"{info.get('host') or '127.0.0.1'}:{info['port']}"
        rep["proxy_id"] = comp.name
        rep["address"] = address
        launcher.update(comp, port=int(info["port"]), address=address)
    launcher.save()
    return record


def router_addr_args(launcher: Launcher) -> list[str]:
    """`--router-addr` for a data proxy: the router's address, as the gateway has it, where
    the proxy asks for its peers when its engine dies under a request (migration)."""
    address = (launcher.state.get("router") or {}).get("address", "")
    return ["--router-addr", address] if address else []


def proxy_db_path(service: str, proxy: str) -> Path:
    """`$AREAL_HOME/inf/data/<svc>/<proxy>.sqlite`: kept after stop, like the logs."""
    d = st.group_dir(GROUP) / "data" / service
    make_dir(d)
    return d / f"{proxy}.sqlite"


def _engine_port() -> int:
    for _ in range(20):
        port = supervisor.free_port()
        if not supervisor.port_in_use("127.0.0.1", port):
            return port
    raise CLIError("could not find a free port for an engine")


def _http_check(url: str):
    return lambda: supervisor.http_ok(url, timeout=1.0)


def register_with_gateway(
    gateway_url: str, key: str, record: dict[str, Any], bounds: dict[str, int] | None = None
) -> None:
    """Register the model's proxies, then set its admission bounds (if any)."""
    body = {
        "name": record["name"],
        "kind": "internal",
        "proxies": [
            {"proxy_id": r["proxy_id"], "address": r["address"]} for r in record["replicas"]
        ],
    }
    status, payload = call("POST", gateway_url + "/admin/models", key=key, body=body, timeout=30)
    if status not in (200, 201):
        raise CLIError(
            f"gateway refused to register model '{record['name']}': HTTP {status}: "
            f"{error_message(payload)}"
        )
    admission.apply(gateway_url, key, record["name"], bounds or {})
    record["phase"] = "running"


# ------------------------------------------------------------------- run


@dataclass
class RunOptions:
    service: str | None
    host: str | None
    port: int | None
    admin_api_key: str | None
    scheduler: str | None
    detach: bool
    force: bool
    routing_strategy: str | None
    log_level: str | None
    launch_timeout: float | None
    model: ModelOptions
    supervise: bool | None = None
    ray_address: str | None = None
    gateways: int | None = None


def response_store(launcher: Launcher) -> Path:
    """The stored Responses (`previous_response_id`, GET /v1/responses/{id}) in one SQLite
    file every gateway of the service shares, and a restarted one reads back; a new run
    starts without the last run's. With gateways on other nodes and `[scheduler] shared_dir`,
    the file in shared_dir that they use too (cluster/ray_gateways.py)."""
    ray = launcher.state.get("ray") or {}
    if ray.get("gateway_nodes") and ray.get("shared_dir"):
        # The folder a unit host calls `{data}` (cluster/host.py).
        path = Path(ray["shared_dir"]) / launcher.group / launcher.service / "responses.sqlite"
    else:
        path = st.run_dir(launcher.group, launcher.service) / "responses.sqlite"
    make_dir(path.parent)
    for leftover in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        leftover.unlink(missing_ok=True)
    return path


def run(cfg: Config, o: RunOptions) -> int:
    service = st.check_name("service", cfg.pick(o.service, "default", "service", "default"))
    given = o.model.given()
    if o.model.name is None and given:
        raise CLIError(f"model registration flags require --model. (got {', '.join(given)})", 2)
    scheduler = cfg.pick(o.scheduler, "scheduler", "type", "local")
    if scheduler not in SCHEDULERS:
        raise CLIError(
            f"invalid --scheduler '{scheduler}' (choose from {', '.join(SCHEDULERS)})", code=2
        )
    if o.ray_address and scheduler != "ray":
        raise CLIError("--ray-address needs --scheduler ray", code=2)
    ray_settings: dict[str, Any] = {}
    if scheduler == "ray":
        from areal_cli.cluster import ray_scheduler

        ray_settings = ray_scheduler.scheduler_settings(cfg, o.ray_address)
        # A cluster that is not there fails the command now; the device resource is pinned.
        ray = ray_scheduler.connect(ray_settings["ray_address"])
        ray_settings["device_resource"] = ray_scheduler.device_resource(
            ray, ray_settings["device_resource"]
        )
        ray_settings["driver_node"] = ray.util.get_node_ip_address()
        ray_settings["gcs_address"] = ray.get_runtime_context().gcs_address
        ray_scheduler.check_gateway_nodes(ray, ray_settings)
    host = cfg.pick(o.host, "launch", "gateway_host", "127.0.0.1")
    port = int(cfg.pick(o.port, "launch", "gateway_port", DEFAULT_PORT))
    if not 0 <= port <= 65535:
        raise CLIError(f"--port {port} is out of range", code=2)
    gateways = check_gateways(int(cfg.pick(o.gateways, "launch", "gateways", 1)))
    strategy = cfg.pick(o.routing_strategy, "launch", "routing_strategy", "round_robin")
    if strategy not in ROUTING_STRATEGIES:
        raise CLIError(
            f"invalid --routing-strategy '{strategy}' (choose from {', '.join(ROUTING_STRATEGIES)})",
            code=2,
        )
    log_level = check_log_level(
        o.log_level or cfg.get("launch", "log_level") or cfg.get("default", "log_level") or "info"
    )
    timeout = float(cfg.pick(o.launch_timeout, "launch", "launch_timeout", DEFAULT_LAUNCH_TIMEOUT))
    if timeout <= 0:
        raise CLIError("--launch-timeout must be positive", code=2)
    key = (
        o.admin_api_key or cfg.get("launch", "admin_api_key") or cfg.get("default", "admin_api_key")
    )
    key_source = "given"
    if not key and o.force:
        key, key_source = st.recorded_admin_key(GROUP, service), "kept"
    if not key:
        key, key_source = "areal-" + secrets.token_urlsafe(24), "generated"
    spec = resolve_model(cfg, o.model, "--model") if o.model.name is not None else None

    policy = policy_from_config(cfg, o.supervise)

    # Everything that can be checked before a process starts is checked here.
    router_bin = resolve_binary(cfg, "router")
    gateway_bin = resolve_binary(cfg, "gateway")
    proxy_bin = resolve_binary(cfg, "proxy") if spec else ""
    opts = {"log_level": log_level, "launch_timeout": timeout}

    def new_state() -> dict[str, Any]:
        return {
            "version": 1,
            "group": GROUP,
            "service": service,
            "instance": uuid.uuid4().hex,
            "phase": "starting",
            "scheduler": scheduler,
            **({"ray": ray_settings} if ray_settings else {}),
            "created_at": time.time(),
            "owner": self_identity(foreground=not o.detach),
            "routing_strategy": strategy,
            "log_level": log_level,
            "launch_timeout": timeout,
            "model_health_timeout": spec.health_timeout if spec else DEFAULT_MODEL_HEALTH_TIMEOUT,
            "supervision": policy.to_dict(),
            "admin_key_source": key_source,
            "gateway": {"host": host, "port": port, "url": ""},
            "gateways": gateways,
            "router": {"address": ""},
            "components": {},
            "models": {},
        }

    def start(launcher: Launcher) -> None:
        if scheduler == "ray":
            from areal_cli.cluster import ray_scheduler

            ray_scheduler.setup_tls(launcher)
        start_router_gateway(
            launcher,
            router_bin=router_bin,
            gateway_bin=gateway_bin,
            host=host,
            port=port,
            admin_api_key=key,
            policy=strategy,
            common_args=["--log-level", log_level],
            gateway_args=["--response-store", str(response_store(launcher))],
            timeout=lambda: timeout,
            # With Ray the data proxies on other nodes reach the router (migration): it
            # listens on this node's address, over the service's mutual TLS.
            router_host=ray_settings["driver_node"] if scheduler == "ray" else "127.0.0.1",
            gateways=gateways,
        )
        if spec is not None:
            record = start_model(launcher, spec, proxy_bin, opts)
            register_with_gateway(launcher.state["gateway"]["url"], key, record, spec.admission)
            progress(f"model '{spec.name}' registered ({launcher.elapsed():.1f}s)")

    return run_service(
        GROUP,
        service,
        force=o.force,
        host=host,
        port=port,
        port_setting="[launch] gateway_port",
        admin_api_key=key,
        extra_secrets=None,
        new_state=new_state,
        start=start,
        detach=o.detach,
        supervise=policy.enabled,
        summary=lambda launcher: _print_summary(service, launcher.state, key_source, o.detach),
    )


def _print_summary(service: str, state: dict[str, Any], key_source: str, detached: bool) -> None:
    how = "running in the background" if detached else "running (Ctrl-C stops it)"
    print(f"inf service '{service}' is {how}")
    print(f"  gateway    {state['gateway']['url']}")
    for name, m in state.get("models", {}).items():
        print(f"  model      {name} ({m['backend']}, {len(m['replicas'])} replica(s))")
    where = st.secrets_path(GROUP, service)
    if key_source in ("generated", "kept"):
        how = "generated" if key_source == "generated" else "kept from the replaced service"
        print(f"  admin key  {how}; stored in {where} (mode 0600)")
    print(f"  status     areal inf status --service {service}")
    print(f"  stop       areal inf stop --service {service}", flush=True)
