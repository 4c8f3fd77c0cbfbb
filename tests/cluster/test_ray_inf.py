"""`areal inf run --scheduler ray` on a real two-node Ray cluster (one namespace per node).

The CLI runs on node 1 (a Ray driver needs its node's raylet), so do the gateway and the
router; `sglang:d2` puts one replica (the real CPU SGLang engine with tiny-parrot, and its
data proxy) on each node. The tests talk to the gateway over the bridge with the official
`openai` SDK, as a trainer on another machine would. Before the last (stop), node 2 is
killed under RL load and its replica comes back on node 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
PARROT = REPO / "models" / "tiny-parrot"
ADMIN_KEY = "areal-ray-test-admin-key"
SERVICE = "rayt"
MODEL = "tiny"

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


class Cli:
    """`areal` run inside node 1, with its own AREAL_HOME."""

    def __init__(self, cluster, home: Path, service: str = SERVICE) -> None:
        self.cluster = cluster
        self.home = home
        self.service = service
        self.areal = shutil.which("areal")
        assert self.areal, "the areal CLI is not on PATH (uv sync)"

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = self.cluster.env({"AREAL_HOME": str(self.home), "RAY_ADDRESS": self.cluster.address})
        return subprocess.run(
            self.cluster.exec_argv(1, [self.areal, *args]),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def popen(self, *args: str) -> subprocess.Popen:
        env = self.cluster.env({"AREAL_HOME": str(self.home), "RAY_ADDRESS": self.cluster.address})
        return subprocess.Popen(
            self.cluster.exec_argv(1, [self.areal, *args]),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # nsenter forks: the whole group is stopped below
        )

    def status(self) -> dict:
        r = self("inf", "status", "--service", self.service, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory):
    home = tmp_path_factory.mktemp("areal-home")
    # The usual shared file system of a training cluster: recorded data survives node loss.
    shared = tmp_path_factory.mktemp("shared")
    (home / "inf").mkdir(mode=0o700)
    # One more gateway on node 2 (docs/cluster.md, "Gateways on other nodes").
    (home / "inf" / "config.toml").write_text(
        f'[scheduler]\nshared_dir = "{shared}"\ngateway_nodes = ["{ray_cluster.ip(2)}"]\n'
    )
    cli = Cli(ray_cluster, home)
    r = cli(
        "inf", "run",
        "--service", SERVICE,
        "--scheduler", "ray",
        "--ray-address", ray_cluster.address,
        "--host", ray_cluster.ip(1),
        "--port", "18080",
        "--gateways", "2",
        "--admin-api-key", ADMIN_KEY,
        "--model", MODEL,
        "--backend", "sglang:d2",
        "--model-path", str(PARROT),
        "--proxy-args", "--request-timeout 120 --chat-template-type hf",
        "--detach",
        timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    yield cli
    cli("inf", "stop", "--service", SERVICE, "--force", timeout=120)


def _gateway(cli: Cli) -> str:
    return cli.status()["gateway"]["url"]


def test_status_names_every_components_node(svc, ray_cluster):
    doc = svc.status()
    assert doc["scheduler"] == "ray" and doc["status"] == "running", doc
    [model] = doc["models"]
    nodes = {r["data_proxy"]["node"] for r in model["replicas"]}
    assert nodes == {ray_cluster.ip(1), ray_cluster.ip(2)}, nodes
    for r in model["replicas"]:
        assert r["worker"]["node"] == r["data_proxy"]["node"]  # engine beside its proxy
        assert r["data_proxy"]["address"].startswith(r["data_proxy"]["node"] + ":")
    assert doc["gateway"]["node"] == ray_cluster.ip(1) and doc["router"]["node"] == ray_cluster.ip(
        1
    )
    # --gateways 2 on a Ray service: both on the CLI's node, on the one port, both answering;
    # and [scheduler] gateway_nodes' one on node 2.
    gws = [c for c in doc["components"].values() if c["role"] == "gateway"]
    assert sorted(g["node"] for g in gws) == [ray_cluster.ip(1)] * 2 + [ray_cluster.ip(2)]
    assert doc["gateway"]["gateways"] == doc["gateway"]["gateways_healthy"] == 3, doc["gateway"]
    r = svc("inf", "status", "--service", SERVICE)
    assert r.returncode == 0 and ray_cluster.ip(2) in r.stdout and "NODE" in r.stdout


def test_chat_through_both_nodes_stream_and_not(svc):
    client = openai.OpenAI(base_url=_gateway(svc) + "/v1", api_key=ADMIN_KEY, timeout=120)
    for i in range(4):  # round robin: two on each replica
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4
        )
        assert out.choices[0].message.content
    text = ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream"}], max_tokens=4, stream=True
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text
    with httpx.Client(timeout=10) as h:
        models = h.get(
            _gateway(svc) + "/admin/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).json()["models"]
    [m] = [m for m in models if m["name"] == MODEL]
    assert len(m["workers"]) == 2 and all(w["health"] == "healthy" for w in m["workers"]), m


def test_rl_session_on_the_remote_replica_records_and_exports(svc, parrot_tokenizer):
    url = _gateway(svc)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(timeout=120) as h:
        got = {}
        for _ in range(4):  # sessions are placed round robin: find one on node 2
            s = h.post(url + "/rl/start_session", json={"task_id": "t"}, headers=admin)
            assert s.status_code == 201, s.text
            [sess] = s.json()["sessions"]
            key = sess["session_api_key"]
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=120)
            parts = []
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "remember"}],
                max_tokens=4,
                stream=True,
            ):
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")
            r = h.post(
                url + "/rl/set_reward",
                json={"reward": 1.0},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
            got[sess["session_id"]] = "".join(parts)
        e = h.post(
            url + "/rl/export_trajectories",
            json={"session_ids": list(got)},
            headers=admin,
        )
        assert e.status_code == 200, e.text
        rows = e.json()["rows"] if isinstance(e.json(), dict) else e.json()
    by_session = {r["session_id"]: r for r in rows}
    assert set(by_session) == set(got)
    for sid, text in got.items():
        row = by_session[sid]
        assert row["reward"] == 1.0
        out = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert parrot_tokenizer.decode(out) == text  # exactly what was streamed


def test_logs_of_a_remote_component(svc):
    r = svc("inf", "logs", "--service", SERVICE, "--component", f"{MODEL}-data-proxy-1", "-n", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no log lines came back from node 2"


REMOTE_GW = "gateway-remote-0"


def test_a_gateway_on_node_2_serves_over_tls_and_shows_everywhere(svc, ray_cluster):
    """The node-2 gateway reaches the router (node 1) and both replicas' proxies over the
    service's mutual TLS; status, ps and logs show it; a Responses chain started on one
    gateway continues on the other (one store in shared_dir)."""
    doc = svc.status()
    gw = doc["components"][REMOTE_GW]
    url = f"http://{ray_cluster.ip(2)}:18080"
    assert gw["role"] == "gateway" and gw["node"] == ray_cluster.ip(2), gw
    assert gw["url"] == url and gw["alive"] and gw["healthy"] and gw["pid"] > 0, gw

    client = openai.OpenAI(base_url=url + "/v1", api_key=ADMIN_KEY, timeout=120)
    for i in range(2):  # round robin: one on each node's replica
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"far {i}"}], max_tokens=2
        )
        assert out.choices[0].message.content
    first = client.responses.create(model=MODEL, input="one", max_output_tokens=2)
    near = openai.OpenAI(base_url=_gateway(svc) + "/v1", api_key=ADMIN_KEY, timeout=120)
    second = near.responses.create(
        model=MODEL, input="two", previous_response_id=first.id, max_output_tokens=2
    )
    assert second.id != first.id
    r = svc("inf", "status", "--service", SERVICE)
    assert r.returncode == 0 and REMOTE_GW in r.stdout and url in r.stdout, r.stdout
    r = svc("inf", "ps")
    assert r.returncode == 0 and url in r.stdout, r.stdout
    r = svc("inf", "logs", "--service", SERVICE, "--component", REMOTE_GW, "-n", "50")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert ADMIN_KEY not in r.stdout


def test_a_dead_remote_gateway_is_restarted_by_its_host(svc, ray_cluster):
    before = svc.status()["components"][REMOTE_GW]
    # Its pid as this (the parent) pid namespace numbers it, not node 2's.
    [pid] = [p for p in ray_cluster.pids_in_node(2) if b"areal-gateway" in _cmdline(p)]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = svc.status()["components"][REMOTE_GW]
        if now["restarts"] >= 1 and now["state"] == "running" and now.get("healthy"):
            break
        time.sleep(1)
    else:
        pytest.fail(f"not restarted: {now}")
    assert now["url"] == before["url"] and now["pid"] != before["pid"]  # same address
    client = openai.OpenAI(base_url=now["url"] + "/v1", api_key=ADMIN_KEY, timeout=120)
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "back"}], max_tokens=2
    ).choices


def test_logs_follow_a_remote_component_as_it_writes(svc):
    """`logs -f` of node 2's engine: what it logs for requests sent meanwhile comes through."""
    follow = svc.popen(
        "inf", "logs", "--service", SERVICE, "--component", f"{MODEL}-worker-1", "-f", "-n", "0"
    )
    try:
        time.sleep(3)
        client = openai.OpenAI(base_url=_gateway(svc) + "/v1", api_key=ADMIN_KEY, timeout=120)
        got = b""
        deadline = time.monotonic() + 60
        os.set_blocking(follow.stdout.fileno(), False)
        while time.monotonic() < deadline and not got:
            for i in range(2):  # round robin: one reaches replica 1
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"log {i}"}], max_tokens=2
                )
            time.sleep(1)
            got += follow.stdout.read() or b""
        assert follow.poll() is None, follow.stderr.read()
        assert got, "logs -f showed nothing of node 2's engine while it served requests"
    finally:
        os.killpg(follow.pid, signal.SIGTERM)
        follow.wait(timeout=30)


def _remote_proxy(svc, ray_cluster) -> dict:
    [model] = [m for m in svc.status()["models"] if m["name"] == MODEL]
    [rep] = [r for r in model["replicas"] if r["data_proxy"]["node"] == ray_cluster.ip(2)]
    return rep["data_proxy"]


def test_internal_ports_refuse_plaintext_and_a_client_without_the_token(svc, ray_cluster):
    import grpc

    from areal_proto.proxy.v1 import proxy_pb2, proxy_pb2_grpc

    address = _remote_proxy(svc, ray_cluster)["address"]
    tls_dir = svc.home / "inf" / "run" / SERVICE / "tls"
    secrets = json.loads((svc.home / "inf" / "services" / f"{SERVICE}.secrets").read_text())

    def stats(channel, metadata=()):
        stub = proxy_pb2_grpc.ProxyStatusServiceStub(channel)
        return stub.GetStats(proxy_pb2.GetStatsRequest(), timeout=10, metadata=metadata)

    with grpc.insecure_channel(address) as plain, pytest.raises(grpc.RpcError) as info:
        stats(plain)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = grpc.ssl_channel_credentials(
        root_certificates=(tls_dir / "ca.pem").read_bytes(),
        private_key=(tls_dir / "key.pem").read_bytes(),
        certificate_chain=(tls_dir / "cert.pem").read_bytes(),
    )
    opts = [("grpc.ssl_target_name_override", "areal-internal")]
    with grpc.secure_channel(address, creds, options=opts) as tls:
        with pytest.raises(grpc.RpcError) as info:
            stats(tls)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        token = secrets["internal_token"]
        got = stats(tls, (("x-areal-internal-token", token),))
    # The RL test's sessions went round robin: node 2's proxy holds some of them, so what
    # that test exported came (in part) from the remote replica.
    assert got.sessions >= 1, got
    # Nothing the service runs listens on a wildcard address on either node, the watchdog
    # included (it reads the hosts' published state without becoming a Ray driver). Ray
    # 2.60's own gRPC servers do, the core worker inside a driver included: docs/cluster.md.
    for i in (1, 2):
        out = ray_cluster.run(i, [sys.executable, "-c", _WILDCARD_LISTENERS], timeout=30).stdout
        assert json.loads(out) == [], out


def test_a_dead_proxy_process_is_restarted_by_its_host(svc, ray_cluster):
    before = _remote_proxy(svc, ray_cluster)
    [pid] = [
        p
        for p in ray_cluster.pids_in_node(2)
        if b"areal-proxy" in _cmdline(p) and before["name"].encode() in _cmdline(p)
    ]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _remote_proxy(svc, ray_cluster)
        if now["restarts"] >= 1 and now["state"] == "running" and now["alive"]:
            break
        time.sleep(1)
    else:
        pytest.fail(f"not restarted: {now}")
    assert now["address"] == before["address"]  # same port: nothing to re-register
    client = openai.OpenAI(base_url=_gateway(svc) + "/v1", api_key=ADMIN_KEY, timeout=120)
    for i in range(2):
        assert client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"again {i}"}], max_tokens=2
        ).choices


def test_register_and_deregister_a_second_model(svc):
    r = svc(
        "inf", "register",
        "--service", SERVICE,
        "--model-name", "tiny2",
        "--backend", "sglang:d1",
        "--model-path", str(PARROT),
        "--proxy-args", "--chat-template-type hf",
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    [m] = [m for m in svc.status()["models"] if m["name"] == "tiny2"]
    assert m["replicas"][0]["data_proxy"]["node"].startswith("198.18.0.")
    client = openai.OpenAI(base_url=_gateway(svc) + "/v1", api_key=ADMIN_KEY, timeout=120)
    out = client.chat.completions.create(
        model="tiny2", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert out.choices
    r = svc("inf", "deregister", "--service", SERVICE, "--model-name", "tiny2")
    assert r.returncode == 0, r.stderr
    assert [m["name"] for m in svc.status()["models"]] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="tiny2", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def _leftovers(ray_cluster, service: str) -> dict:
    """Actors and live placement groups of `service` that Ray still lists."""
    check = ray_cluster.run(
        1,
        [
            sys.executable,
            "-c",
            "import ray,json; ray.init(address='auto', logging_level='ERROR');"
            "from ray.util import placement_group_table as t;"
            "print(json.dumps({'actors': [a['name'] for a in "
            "ray.util.list_named_actors(all_namespaces=True)],"
            "'pgs': [v['name'] for v in t().values() if v['state'] != 'REMOVED']}))",
        ],
        env=ray_cluster.env(),
        timeout=60,
    )
    doc = json.loads(check.stdout.strip().splitlines()[-1])
    prefix = f"areal-inf-{service}-"
    return {k: [n for n in v if n.startswith(prefix)] for k, v in doc.items()}


def test_replicas_that_cannot_be_placed_fail_naming_the_resources(svc, ray_cluster):
    r = svc(
        "inf", "run",
        "--service", "toobig",
        "--scheduler", "ray",
        "--port", "18090",
        "--model", "big",
        "--backend", "sglang:d1t4",
        "--model-path", str(PARROT),
        "--detach",
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot place 1 unit(s) of 4 CPU each" in r.stderr and "largest node" in r.stderr
    assert "Traceback" not in r.stderr
    assert svc("inf", "status", "--service", "toobig").returncode == 1  # no state left
    assert _leftovers(ray_cluster, "toobig") == {"actors": [], "pgs": []}


def test_a_node_without_the_model_folder_fails_naming_the_node(svc, ray_cluster, tmp_path):
    # A folder only node 1 has: a tmpfs mounted in node 1's own mount namespace.
    where = tmp_path / "node1-only"
    where.mkdir()
    ray_cluster.run(1, ["mount", "-t", "tmpfs", "tmpfs", str(where)], timeout=30)
    try:
        ray_cluster.run(1, ["cp", "-r", str(PARROT), str(where)], timeout=60)
        r = svc(
            "inf", "run",
            "--service", "lacking",
            "--scheduler", "ray",
            "--port", "18091",
            "--model", "lacking",
            "--backend", "sglang:d2",
            "--model-path", str(where / PARROT.name),
            "--detach",
            timeout=300,
        )  # fmt: skip
    finally:
        ray_cluster.run(1, ["umount", str(where)], timeout=30, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"node {ray_cluster.ip(2)} lacks the model folder" in r.stderr, r.stderr
    assert svc("inf", "status", "--service", "lacking").returncode == 1
    assert _leftovers(ray_cluster, "lacking") == {"actors": [], "pgs": []}
    for i in (1, 2):
        assert not [p for p in ray_cluster.pids_in_node(i) if b"lacking" in _cmdline(p)]


class Load:
    """RL sessions one after another: start, one chat turn, a reward. A session counts as
    acknowledged once its turn answered 200."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.acked: list[str] = []
        self.errors: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(timeout=30) as h:
            while not self.stop.is_set():
                try:
                    s = h.post(self.url + "/rl/start_session", json={"task_id": "t"}, headers=admin)
                    if s.status_code != 201:
                        self.errors[f"start {s.status_code}"] += 1
                        time.sleep(0.5)
                        continue
                    [sess] = s.json()["sessions"]
                    key = sess["session_api_key"]
                    c = openai.OpenAI(
                        base_url=self.url + "/v1", api_key=key, timeout=30, max_retries=0
                    )
                    c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
                    )
                    self.acked.append(sess["session_id"])
                    h.post(
                        self.url + "/rl/set_reward",
                        json={"reward": 1.0},
                        headers={"Authorization": f"Bearer {key}"},
                    )
                except (httpx.HTTPError, openai.APIError) as e:
                    self.errors[type(e).__name__] += 1
                    time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        r = httpx.get(
            url + "/admin/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
        )
        [m] = [m for m in r.json()["models"] if m["name"] == MODEL]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return len(m["workers"]) == 2 and all(w["health"] == "healthy" for w in m["workers"])


def test_a_lost_node_is_replaced_and_loses_nothing_with_a_shared_dir(svc, ray_cluster):
    """Node 2 killed under RL load: its replica is placed again on node 1 and re-registered
    without operator action; with shared_dir no acknowledged interaction is lost. Prints one
    row like benchmarks/fault_table.py's."""
    url = svc.status()["gateway"]["url"]
    load = Load(url)
    load.thread.start()
    try:
        time.sleep(8)
        before = len(load.acked)
        assert before > 0, load.errors
        t0 = time.monotonic()
        ray_cluster.kill_node(2)
        deadline = time.monotonic() + 300
        moved = False
        while time.monotonic() < deadline:
            doc = svc.status()
            nodes = {r["data_proxy"]["node"] for r in doc["models"][0]["replicas"]}
            moved = nodes == {ray_cluster.ip(1)}
            if moved and _healthy(url):
                break
            time.sleep(2)
        healed = time.monotonic() - t0
        assert moved and _healthy(url), doc
        time.sleep(5)  # load on the healed service
    finally:
        load.stop.set()
        load.thread.join(timeout=60)
    after = len(load.acked)
    assert after > before, "no session was served after the node came back"
    moves = [r["data_proxy"].get("moves", 0) for r in doc["models"][0]["replicas"]]
    assert sorted(moves) == [0, 1], moves
    with httpx.Client(timeout=120) as h:
        e = h.post(
            url + "/rl/export_trajectories",
            json={"session_ids": load.acked},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
    assert e.status_code == 200, e.text
    exported = {row["session_id"] for row in e.json()["rows"]}
    lost = [s for s in load.acked if s not in exported]
    errors = ", ".join(f"{k} {v}" for k, v in sorted(load.errors.items())) or "none"
    print(
        f"\nnode loss | errors: {errors} | healthy again after {healed:.1f}s | "
        f"acknowledged {len(load.acked)}, lost {len(lost)}"
    )
    assert not lost


def test_stop_leaves_nothing_on_any_node(svc, ray_cluster):
    # After the node-loss test both replicas run on node 1; node 2 is started again once
    # the service (and its two busy engines) is gone, so the cluster is whole again.
    r = svc("inf", "stop", "--service", SERVICE)
    assert r.returncode == 0, r.stderr
    for i in (1, 2):
        left = [p for p in ray_cluster.pids_in_node(i) if _ours(p)]
        assert not left, f"node {i}: {left}"
    assert _leftovers(ray_cluster, SERVICE) == {"actors": [], "pgs": []}
    if ray_cluster.ip(2) not in ray_cluster.alive_ips():
        ray_cluster.start_node(2)


# Run inside a node: listeners of areal's servers and engines on 0.0.0.0 or [::].
_WILDCARD_LISTENERS = r"""
import json, re, subprocess
out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout
bad = []
for line in out.splitlines():
    local = line.split()[3]
    if not (local.startswith("0.0.0.0:") or local.startswith("*:") or local.startswith("[::]:")):
        continue
    for pid in re.findall(r"pid=(\d+)", line):
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        ours = (b"areal-proxy", b"areal-gateway", b"areal-router", b"areal_cli.watchdog", b"sglang")
        if any(s in cmd for s in ours):
            bad.append([local, cmd.decode(errors="replace")[:200]])
print(json.dumps(bad))
"""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ours(pid: int) -> bool:
    cmd = _cmdline(pid)
    return b"sglang" in cmd or b"areal-proxy" in cmd
