"""A model's replicas on a Ray cluster: one unit (engine + data proxy) per bundle.

The same engine command line and proxy flags as `local` (inf/launch.py), with the
addresses left as placeholders the unit's host fills in on its node: the engine on the
node's loopback, the proxy on the node's address (where the gateway and router reach it,
over TLS with the internal token).
"""

from __future__ import annotations

import shlex
import time
from typing import Any

from areal_cli import engines
from areal_cli.cluster import ray_scheduler as rs
from areal_cli.components import Component
from areal_cli.inf.launch import router_addr_args
from areal_cli.launcher import Launcher, progress

GROUP = "inf"


def start_model_ray(
    launcher: Launcher, spec: Any, proxy_bin: str, opts: dict[str, Any], defaults: list[str]
) -> dict[str, Any]:
    """Place and start every replica of `spec`; its state record (as `start_model`'s)."""
    sched = launcher.state["ray"]
    ray = rs.connect(sched["ray_address"])
    resource = rs.device_resource(ray, sched.get("device_resource"))
    per_unit = spec.backend.tp * spec.backend.pp
    dp = spec.backend.dp
    record: dict[str, Any] = {
        "name": spec.name,
        "kind": "internal",
        "backend": str(spec.backend),
        "engine": spec.backend.engine,
        "model_path": spec.model_path,
        "tokenizer_path": spec.tokenizer_path,
        "engine_args": spec.engine_args,
        "proxy_args": spec.proxy_args,
        "phase": "starting",
        "replicas": [],
        "placement_group": rs.pg_name(GROUP, launcher.service, spec.name),
        "device_resource": resource,
    }
    launcher.state.setdefault("models", {})[spec.name] = record
    progress(
        f"placing {dp} {spec.backend.engine} replica(s) of '{spec.name}' on the Ray cluster "
        f"({per_unit} {resource} each)"
    )
    pg = rs.place(
        ray, record["placement_group"], dp, per_unit, resource, opts["launch_timeout"] + 30
    )
    tls = rs.service_tls(GROUP, launcher.service)
    actors = {}
    for rank in range(dp):
        worker, proxy = f"{spec.name}-worker-{rank}", f"{spec.name}-data-proxy-{rank}"
        actor = rs.actor_name(GROUP, launcher.service, f"{spec.name}-{rank}")
        unit = _unit(launcher, spec, proxy_bin, opts, defaults, worker, proxy, tls)
        common = {
            "model": spec.name,
            "rank": rank,
            "actor": actor,
            "ray_address": sched["ray_address"],
            "placement_group": record["placement_group"],
            "started_at": time.time(),
            "cwd": "",
        }
        for name, role, extra in (
            (worker, "engine", {}),
            (proxy, "proxy", {"proxy_id": proxy}),
        ):
            comp = Component(
                name,
                0,
                0,
                0,
                [],
                f"{name} on its node",
                meta={"role": role, "unit_process": name, **common, **extra},
            )
            launcher.started.append(comp)
            launcher.state.setdefault("components", {})[name] = comp.to_dict()
        record["replicas"].append(
            {"rank": rank, "gpus": [], "worker": worker, "data_proxy": proxy, "actor": actor}
        )
        launcher.save()
        actors[actor] = rs.start_unit(ray, pg, rank, actor, unit, resource, per_unit)
    t0 = time.monotonic()
    infos = rs.wait_units(ray, actors, spec.health_timeout + opts["launch_timeout"])
    progress(f"  replicas ready after {time.monotonic() - t0:.1f}s")
    for rep in record["replicas"]:
        info = infos[rep["actor"]]
        proc = info["processes"][rep["data_proxy"]]
        rep["proxy_id"] = rep["data_proxy"]
        rep["address"] = proc["address"]
        rep["node"] = info["node_ip"]
        rep["engine_url"] = f"http://127.0.0.1:{info['processes'][rep['worker']].get('port', 0)}"
        for name in (rep["worker"], rep["data_proxy"]):
            c = launcher.state["components"][name]
            c["host"] = info["node_ip"]
            c["meta"].update(node=info["node_ip"], node_id=info["node_id"], placed=True)
            p = info["processes"][name]
            c["log"] = p["log"]
            if name == rep["data_proxy"]:
                c["port"] = p["port"]
                c["meta"]["address"] = p["address"]
        progress(f"  replica {rep['rank']} on node {info['node_ip']} (proxy {rep['address']})")
    launcher.save()
    return record


def _unit(
    launcher: Launcher,
    spec: Any,
    proxy_bin: str,
    opts: dict[str, Any],
    defaults: list[str],
    worker: str,
    proxy: str,
    tls: dict[str, str],
) -> dict[str, Any]:
    launch = engines.engine_launch(
        spec.backend.engine,
        python=spec.python,
        model_path=spec.model_path,
        served_name=spec.name,
        host="127.0.0.1",
        port="{port:engine}",
        tokenizer_path=spec.tokenizer_path if spec.tokenizer_path != spec.model_path else None,
        extra_args=defaults,
        user_args=shlex.split(spec.engine_args),
        tensor_parallel=spec.backend.tp,
    )
    proxy_argv = [
        proxy_bin,
        "--host",
        "{node_ip}",
        "--port",
        "{port:proxy}",
        "--ready-file",
        "{run}/" + proxy + ".ready",
        "--log-level",
        opts["log_level"],
        "--engine-url",
        "http://127.0.0.1:{port:engine}",
        "--engine",
        spec.backend.engine,
        "--model",
        spec.name,
        "--tokenizer-path",
        spec.tokenizer_path,
        "--proxy-id",
        proxy,
        "--db-path",
        "{data}/" + proxy + ".sqlite",
        # The router listens on the CLI's node address with Ray (inf/launch.py `run`).
        *router_addr_args(launcher),
        *shlex.split(spec.proxy_args),
    ]
    return rs.unit_doc(
        launcher,
        f"{spec.name}-{worker.rsplit('-', 1)[1]}",
        tls,
        needs=[
            (f"the {spec.backend.engine} engine's python", spec.python),
            ("the model folder", spec.model_path),
            ("the tokenizer folder", spec.tokenizer_path),
            ("the areal-proxy binary", proxy_bin),
        ],
        processes=[
            {
                "name": worker,
                "argv": launch.argv,
                "env": launch.env,
                "loopback_preload": True,
                "ready": {"http": "http://127.0.0.1:{port:engine}" + launch.health_path},
                "timeout": spec.health_timeout,
                "address_port": "engine",
            },
            {
                "name": proxy,
                "argv": proxy_argv,
                "env": {"AREAL_INTERNAL_TOKEN": launcher.env["AREAL_INTERNAL_TOKEN"]},
                "ready": {"file": True},
                "timeout": opts["launch_timeout"],
                "address_port": "proxy",
            },
        ],
    )
