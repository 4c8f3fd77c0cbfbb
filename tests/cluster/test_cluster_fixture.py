"""The netns cluster is a real cluster: a detached actor in a SPREAD placement group lands on
the worker node, its child process serves on the worker's address and is reached over the
bridge (not loopback), and killing the node leaves nothing of it and is noticed by the head."""

from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest
from netns_cluster import NetnsCluster

pytestmark = pytest.mark.cluster

WORKER_IP = "198.18.0.12"

# A tiny TCP server: prints its port, answers every connection with its marker line.
SERVER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(("hello " + sys.argv[2] + "\\n").encode())
    c.close()
"""

# Runs on the head node as a Ray driver: "create" makes the placement group and the detached
# actor (which starts the server) and exits; "check" finds the actor again; "remove" cleans up.
DRIVER = """
import json, subprocess, sys, time
import ray
from ray.util.placement_group import (
    get_placement_group, placement_group, placement_group_table, remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

mode, address, ns, server, marker = sys.argv[1:6]
ray.init(address=address, namespace=ns, log_to_driver=False)
ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


@ray.remote(num_cpus=1, max_restarts=0)
class Server:
    def start(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", server, ray.util.get_node_ip_address(), marker],
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        return ray.util.get_node_ip_address(), int(self.proc.stdout.readline())

    def where(self):
        return ray.util.get_node_ip_address(), self.proc.poll()


if mode == "create":
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD", name="pg",
                         lifetime="detached")
    ray.get(pg.ready(), timeout=60)
    bundles = {int(k): ips[v] for k, v in placement_group_table(pg)["bundles_to_node_id"].items()}
    index = next(k for k, ip in bundles.items() if ip == "198.18.0.12")
    actor = Server.options(
        name="server", lifetime="detached",
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
    ).remote()
    ip, port = ray.get(actor.start.remote(), timeout=60)
    print(json.dumps({"bundles": bundles, "actor_ip": ip, "port": port}))
elif mode == "check":
    ip, returncode = ray.get(ray.get_actor("server").where.remote(), timeout=30)
    print(json.dumps({"actor_ip": ip, "server_returncode": returncode}))
elif mode == "remove":
    try:
        ray.kill(ray.get_actor("server"))
    except ValueError:
        pass  # died with its node
    remove_placement_group(get_placement_group("pg"))
    print(json.dumps({"removed": True}))
"""


def _driver(cluster: NetnsCluster, mode: str, marker: str) -> dict:
    args = [mode, cluster.address, f"fixture-{os.getpid()}", SERVER, marker]
    out = cluster.run(1, [sys.executable, "-c", textwrap.dedent(DRIVER), *args], timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _hello(ip: str, port: int) -> str:
    with socket.create_connection((ip, port), timeout=5) as s:
        return s.makefile().readline().strip()


def test_actor_child_on_worker_reached_over_bridge_then_node_killed(
    ray_cluster: NetnsCluster,
) -> None:
    c = ray_cluster
    marker = f"m{os.getpid()}"
    created = _driver(c, "create", marker)
    assert set(created["bundles"].values()) == {"198.18.0.11", WORKER_IP}  # SPREAD: one each
    assert created["actor_ip"] == WORKER_IP
    port = created["port"]

    # The driver has exited; the detached actor and its child live on.
    checked = _driver(c, "check", marker)
    assert checked == {"actor_ip": WORKER_IP, "server_returncode": None}

    # Root namespace -> bridge -> worker namespace; the worker's address is not local here.
    assert _hello(WORKER_IP, port) == f"hello {marker}"
    with pytest.raises(OSError):
        _hello("127.0.0.1", port)

    # The server process is in the worker node's pid namespace.
    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return ""

    node2 = c.pids_in_node(2)
    assert any(marker in cmdline(p) for p in node2)
    assert not any(marker in cmdline(p) for p in c.pids_in_node(1))

    t0 = time.monotonic()
    c.kill_node(2)
    assert c.pids_in_node(2) == []
    assert all(not Path(f"/proc/{p}").exists() for p in node2)
    with pytest.raises(OSError):
        _hello(WORKER_IP, port)
    c.wait_node_dead(2, timeout=30)
    dead_after = time.monotonic() - t0
    assert dead_after < 15, f"node marked dead only {dead_after:.1f}s after the kill"
    assert c.alive_ips() == {"198.18.0.11"}

    # Leave the session's cluster whole for later tests.
    assert _driver(c, "remove", marker) == {"removed": True}
    c.start_node(2)
    assert c.alive_ips() == {"198.18.0.11", WORKER_IP}
