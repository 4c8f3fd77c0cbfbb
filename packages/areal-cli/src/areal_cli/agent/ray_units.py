"""An agent service's worker/proxy pairs on a Ray cluster: one unit per bundle.

The same worker and proxy flags as `local` (agent/launch.py), with the addresses left as
placeholders the unit's host fills in on its node: the worker on the node's loopback
(only its proxy talks to it), the proxy on the node's address (where the gateway and
router reach it, over TLS with the internal token).

The user's agent code reaches the workers as with `local`: the caller's working
directory first on their PYTHONPATH. On a real cluster that folder must therefore exist
at the same path on every node (a shared file system, or a copy), or the agent's package
must be installed in the worker's environment on every node; a worker that cannot
import it fails the launch with its own message.
"""

from __future__ import annotations

import re
import time
from typing import Any

from areal_cli.agent.launch import (
    WORKER_USAGE_EXIT,
    Plan,
    _common_args,
    _left,
    inf_link,
    register_pair,
    worker_env,
)
from areal_cli.cluster import ray_scheduler as rs
from areal_cli.components import Component
from areal_cli.errors import CLIError
from areal_cli.launcher import Launcher, progress

GROUP = "agent"
PG_WHAT = "pairs"
PER_PAIR = 1  # device resource units a pair's bundle holds
# How a host reports a process that exited while starting (cluster/host.py, UnitHost._start).
_EXITED = re.compile(r"(worker-\d+) exited \(code (\d+)\) on node (\S+); log [^\n]*:\n(.*)", re.S)


def start_pairs_ray(
    launcher: Launcher, plan: Plan, worker_bin: str, proxy_bin: str, deadline: float
) -> None:
    """Place and start every pair of `plan`, record them as `_start_pairs` does and
    register each with the gateway."""
    state = launcher.state
    sched = state["ray"]
    ray = rs.connect(sched["ray_address"])
    resource = rs.device_resource(ray, sched.get("device_resource"))
    pg_name = rs.pg_name(GROUP, launcher.service, PG_WHAT)
    n = plan.num_pairs
    progress(f"placing {n} agent pair(s) on the Ray cluster ({PER_PAIR} {resource} each)")
    pg = rs.place(ray, pg_name, n, PER_PAIR, resource, _left(deadline))
    tls = rs.service_tls(GROUP, launcher.service)
    # The worker's PYTHONPATH is the caller's, its cwd first: without the local env.
    wenv = worker_env({}, state["cwd"])
    penv, link = inf_link(plan)
    common_args = _common_args(plan)
    actors = {}
    for i in range(n):
        pair: dict[str, Any] = {
            "index": i,
            "worker": f"worker-{i}",
            "proxy": f"proxy-{i}",
            "proxy_id": f"proxy-{i}",
            "actor": rs.actor_name(GROUP, launcher.service, f"pair-{i}"),
        }
        state["pairs"].append(pair)
        common = {
            "rank": i,
            "actor": pair["actor"],
            "ray_address": sched["ray_address"],
            "placement_group": pg_name,
            "started_at": time.time(),
            "cwd": "",
        }
        for name, role, extra in (
            (pair["worker"], "worker", {}),
            (pair["proxy"], "proxy", {"proxy_id": pair["proxy_id"]}),
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
            state.setdefault("components", {})[name] = comp.to_dict()
        launcher.save()
        unit = _unit(
            launcher,
            plan,
            pair,
            worker_bin=worker_bin,
            proxy_bin=proxy_bin,
            common_args=common_args,
            worker_env=wenv,
            proxy_env={"AREAL_INTERNAL_TOKEN": launcher.env["AREAL_INTERNAL_TOKEN"], **penv},
            link=link,
            tls=tls,
            timeout=_left(deadline),
        )
        actors[pair["actor"]] = rs.start_unit(ray, pg, i, pair["actor"], unit, resource, PER_PAIR)
    t0 = time.monotonic()
    try:
        infos = rs.wait_units(ray, actors, _left(deadline))
    except CLIError as e:
        raise _agent_load_error(e) from None
    progress(f"  pairs ready after {time.monotonic() - t0:.1f}s")
    for pair in state["pairs"]:
        info = infos[pair["actor"]]
        wproc = info["processes"][pair["worker"]]
        pproc = info["processes"][pair["proxy"]]
        pair["node"] = info["node_ip"]
        pair["worker_address"] = f"127.0.0.1:{wproc.get('port', 0)}"  # on its node
        pair["address"] = pproc["address"]
        for name, proc in ((pair["worker"], wproc), (pair["proxy"], pproc)):
            c = state["components"][name]
            c["host"] = info["node_ip"]
            c["port"] = int(proc.get("port") or 0)
            c["log"] = proc["log"]
            c["meta"].update(node=info["node_ip"], node_id=info["node_id"], placed=True)
        state["components"][pair["worker"]]["meta"]["address"] = pair["worker_address"]
        state["components"][pair["proxy"]]["meta"]["address"] = pair["address"]
        progress(f"  pair {pair['index']} on node {info['node_ip']} (proxy {pair['address']})")
    launcher.save()
    url = state["gateway"]["url"]
    for pair in state["pairs"]:
        register_pair(url, plan.admin_api_key, pair["proxy_id"], pair["address"])
        pair["registered"] = True
    launcher.save()


def _unit(
    launcher: Launcher,
    plan: Plan,
    pair: dict[str, Any],
    *,
    worker_bin: str,
    proxy_bin: str,
    common_args: list[str],
    worker_env: dict[str, str],
    proxy_env: dict[str, str],
    link: list[str],
    tls: dict[str, str],
    timeout: float,
) -> dict[str, Any]:
    worker, proxy = pair["worker"], pair["proxy"]
    worker_argv = [worker_bin, "--agent", plan.agent, "--host", "127.0.0.1"]
    worker_argv += ["--port", "{port:worker}", "--ready-file", "{run}/" + worker + ".ready"]
    worker_argv += common_args
    proxy_argv = [proxy_bin, "--host", "{node_ip}", "--port", "{port:proxy}"]
    proxy_argv += ["--ready-file", "{run}/" + proxy + ".ready", *common_args]
    proxy_argv += ["--worker-addr", "127.0.0.1:{port:worker}", "--proxy-id", pair["proxy_id"]]
    proxy_argv += ["--session-timeout", f"{plan.session_timeout:g}", *link]
    return rs.unit_doc(
        launcher,
        f"pair-{pair['index']}",
        tls,
        needs=[
            ("the areal-agent-worker binary", worker_bin),
            ("the areal-agent-proxy binary", proxy_bin),
        ],
        processes=[
            {
                "name": worker,
                # The internal token too: the worker's gRPC server checks it.
                "argv": worker_argv,
                "env": {"AREAL_INTERNAL_TOKEN": proxy_env["AREAL_INTERNAL_TOKEN"], **worker_env},
                "ready": {"file": True},
                "timeout": timeout,
                "address_port": "worker",
            },
            {
                "name": proxy,
                "argv": proxy_argv,
                "env": proxy_env,
                "ready": {"file": True},
                "timeout": timeout,
                "address_port": "proxy",
            },
        ],
    )


def _agent_load_error(e: CLIError) -> CLIError:
    """A worker that exited 2 (bad --agent) fails with its own one-line message, as local."""
    m = _EXITED.search(e.message)
    if m is None or int(m.group(2)) != WORKER_USAGE_EXIT:
        return e
    lines = [ln.strip() for ln in m.group(4).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("--- ")]
    line = lines[-1] if lines else "exit code 2"
    return CLIError(f"{m.group(1)} could not load the agent on node {m.group(3)}: {line}")
