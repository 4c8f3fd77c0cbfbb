"""`areal inf run --scheduler ray` on a real two-node Ray cluster (one namespace per node).

The CLI runs on node 1 (a Ray driver needs its node's raylet), so do the gateway and the
router; `sglang:d2` puts one replica (the real CPU SGLang engine with tiny-parrot, and its
data proxy) on each node. The tests talk to the gateway over the bridge with the official
`openai` SDK, as a trainer on another machine would. The last test kills node 2 and
watches its replica come back on node 1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
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

    def status(self) -> dict:
        r = self("inf", "status", "--service", self.service, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory):
    cli = Cli(ray_cluster, tmp_path_factory.mktemp("areal-home"))
    r = cli(
        "inf", "run",
        "--service", SERVICE,
        "--scheduler", "ray",
        "--ray-address", ray_cluster.address,
        "--host", ray_cluster.ip(1),
        "--port", "18080",
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
        assert stats(tls, (("x-areal-internal-token", token),)) is not None
    # No server of the service listens on a wildcard address on either node. (Ray 2.60's
    # own gRPC servers do, the core worker inside any Ray driver included: docs/cluster.md.)
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


def test_stop_leaves_nothing_on_any_node(svc, ray_cluster):
    r = svc("inf", "stop", "--service", SERVICE)
    assert r.returncode == 0, r.stderr
    for i in (1, 2):
        left = [p for p in ray_cluster.pids_in_node(i) if _ours(p)]
        assert not left, f"node {i}: {left}"
    check = ray_cluster.run(
        1,
        [
            shutil.which("python") or "python",
            "-c",
            "import ray,json; ray.init(address='auto', logging_level='ERROR');"
            "from ray.util import placement_group_table as t;"
            "print(json.dumps({'actors': ray.util.list_named_actors(all_namespaces=True),"
            "'pgs': [v['name'] for v in t().values() if v['state'] != 'REMOVED']}))",
        ],
        timeout=60,
    )
    doc = json.loads(check.stdout.strip().splitlines()[-1])
    assert not [a for a in doc["actors"] if a["name"].startswith(f"areal-inf-{SERVICE}-")]
    assert not [p for p in doc["pgs"] if p.startswith(f"areal-inf-{SERVICE}-")]


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
        if any(s in cmd for s in (b"areal-proxy", b"areal-gateway", b"areal-router", b"sglang")):
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
