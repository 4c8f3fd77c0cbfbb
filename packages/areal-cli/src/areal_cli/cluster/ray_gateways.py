"""Gateways on other nodes of a Ray cluster: `[scheduler] gateway_nodes` (docs/cluster.md).

Each listed node gets one gateway, a unit of its own: a detached `UnitHost` pinned to that
node (no device), which starts `areal-gateway` on the node's address at the service's port
and restarts it when it dies, as replicas' hosts do. It reaches the router at the CLI
node's address and the proxies at theirs over the service's mutual TLS (the host writes the
TLS files on its node). Its secrets (internal token, admin key, session-key secret) travel
in the unit's process env, as a replica's internal token does: never on argv, never logged.
"""

from __future__ import annotations

import time
from typing import Any

from areal_cli.cluster import ray_scheduler as rs
from areal_cli.components import Component, http_url
from areal_cli.errors import CLIError
from areal_cli.http import gateway_healthy
from areal_cli.launcher import Launcher, progress

STORE_FLAG = "--response-store"


def remote_name(index: int) -> str:
    return f"gateway-remote-{index}"


def gateway_unit(
    launcher: Launcher,
    name: str,
    *,
    gateway_bin: str,
    port: int,
    args: list[str],
    router_address: str,
    admin_api_key: str,
    tls: dict[str, str],
    timeout: float,
) -> dict[str, Any]:
    """What the host of the gateway `name` is given. `args` are the local gateways' flags
    after `--ready-file` (log level, mode, Responses store); the store becomes the host's
    `{data}` folder: `[scheduler] shared_dir` when set (one store for every gateway), else
    a file on the gateway's own node."""
    tail: list[str] = []
    it = iter(args)
    for a in it:
        if a == STORE_FLAG:
            next(it, None)
            tail += [STORE_FLAG, "{data}/responses.sqlite"]
        else:
            tail.append(a)
    argv = [gateway_bin, "--host", "{node_ip}", "--port", str(port)]
    argv += ["--ready-file", "{run}/" + name + ".ready", *tail, "--router-addr", router_address]
    env = {
        "AREAL_INTERNAL_TOKEN": launcher.env["AREAL_INTERNAL_TOKEN"],
        "AREAL_ADMIN_API_KEY": admin_api_key,
        **launcher.gateway_env,
    }
    return rs.unit_doc(
        launcher,
        name,
        tls,
        needs=[("the areal-gateway binary", gateway_bin)],
        processes=[
            {
                "name": name,
                "argv": argv,
                "env": env,
                "ready": {"file": True},
                "timeout": timeout,
                "address": "{node_ip}:" + str(port),
            }
        ],
    )


def start_remote_gateways(
    launcher: Launcher,
    nodes: list[str],
    *,
    gateway_bin: str,
    port: int,
    args: list[str],
    router_address: str,
    admin_api_key: str,
    timeout: float,
) -> None:
    """One gateway per node of `nodes`, recorded as it is placed, all ready or a CLIError
    (the launch's failure path then stops them with the rest)."""
    sched = launcher.state["ray"]
    ray = rs.connect(sched["ray_address"])
    tls = rs.service_tls(launcher.group, launcher.service)
    actors = {}
    names = {}
    for i, node in enumerate(nodes):
        name = remote_name(i)
        actor = rs.actor_name(launcher.group, launcher.service, name)
        unit = gateway_unit(
            launcher,
            name,
            gateway_bin=gateway_bin,
            port=port,
            args=args,
            router_address=router_address,
            admin_api_key=admin_api_key,
            tls=tls,
            timeout=timeout,
        )
        meta = {
            "role": "gateway",
            "unit_process": name,
            "actor": actor,
            "ray_address": sched["ray_address"],
            "started_at": time.time(),
            "cwd": "",
            "node": node,
            "url": http_url(node, port),
        }
        comp = Component(name, 0, 0, 0, [], f"{name} on node {node}", host=node, port=port)
        comp.meta.update(meta)
        launcher.started.append(comp)
        launcher.state.setdefault("components", {})[name] = comp.to_dict()
        launcher.save()
        actors[actor] = rs.start_on_node(ray, actor, unit, node)
        names[actor] = name
    progress(
        f"starting {len(nodes)} gateway(s) on other nodes: {', '.join(nodes)} "
        f"({launcher.elapsed():.1f}s)"
    )
    deadline = time.monotonic() + timeout + 30
    infos = rs.wait_units(ray, actors, timeout + 30)
    for actor, info in infos.items():
        name = names[actor]
        proc = info["processes"][name]
        c = launcher.state["components"][name]
        c["host"], c["port"], c["log"] = info["node_ip"], proc["port"], proc["log"]
        c["meta"].update(
            node=info["node_ip"],
            node_id=info["node_id"],
            placed=True,
            url=http_url(info["node_ip"], proc["port"]),
        )
        launcher.save()
        # Healthy as the CLI's clients see it: from here, at the node's address.
        while not gateway_healthy(c["meta"]["url"], int(proc["pid"])):
            if time.monotonic() > deadline:
                raise CLIError(
                    f"{name} on node {info['node_ip']} started but does not answer "
                    f"{c['meta']['url']}/health from this node; see `areal "
                    f"{launcher.group} logs --component {name}`"
                )
            time.sleep(0.2)
        progress(
            f"  {name} healthy at {c['meta']['url']} (node {info['node_ip']}, "
            f"{launcher.elapsed():.1f}s)"
        )
