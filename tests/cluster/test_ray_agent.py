"""`areal agent run --scheduler ray` on a real two-node Ray cluster (one namespace per node).

The CLI runs on node 1 (a Ray driver needs its node's raylet), from the repository root as
the local agent tests do, so the gateway and the router run there; `--num-pairs 2` puts
one worker/proxy pair of `examples.agents.echo.EchoAgent` on each node (the repository is
at the same path on both: the worker's PYTHONPATH is the caller's working directory). The
tests talk to the gateway over the bridge with the official `openai` SDK, as an
application on another machine would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "areal-ray-agent-admin-key"
SERVICE = "rayag"
ECHO = "examples.agents.echo.EchoAgent"
OURS = (b"areal-agent-worker", b"areal-agent-proxy", b"areal-gateway", b"areal-router")

pytestmark = [pytest.mark.cluster]


class Cli:
    """`areal` run inside node 1 from the repository root, with its own AREAL_HOME."""

    def __init__(self, cluster, home: Path) -> None:
        self.cluster = cluster
        self.home = home
        self.areal = shutil.which("areal")
        assert self.areal, "the areal CLI is not on PATH (uv sync)"

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = self.cluster.env({"AREAL_HOME": str(self.home), "RAY_ADDRESS": self.cluster.address})
        # nsenter starts the command in / (entering a mount namespace resets the cwd).
        return subprocess.run(
            self.cluster.exec_argv(1, ["env", "-C", str(REPO), self.areal, *args]),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def status(self) -> dict:
        r = self("agent", "status", "--service", SERVICE, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory):
    cli = Cli(ray_cluster, tmp_path_factory.mktemp("areal-home"))
    r = cli(
        "agent", "run",
        "--service", SERVICE,
        "--agent", ECHO,
        "--scheduler", "ray",
        "--ray-address", ray_cluster.address,
        "--num-pairs", "2",
        "--host", ray_cluster.ip(1),
        "--admin-api-key", ADMIN_KEY,
        "--health-poll-interval", "0.5",
        "--drain-timeout", "2",
        timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    yield cli
    cli("agent", "stop", "--service", SERVICE, "--force", timeout=120)


def _admin(url: str, path: str) -> dict:
    with httpx.Client(timeout=10) as h:
        r = h.get(url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_status_places_a_pair_on_each_node(svc, ray_cluster):
    doc = svc.status()
    assert doc["scheduler"] == "ray" and doc["status"] == "running", doc
    assert [p["worker"]["name"] for p in doc["pairs"]] == ["worker-0", "worker-1"]
    nodes = {p["proxy"]["node"] for p in doc["pairs"]}
    assert nodes == {ray_cluster.ip(1), ray_cluster.ip(2)}, nodes
    for p in doc["pairs"]:
        assert p["worker"]["alive"] and p["proxy"]["alive"], p
        assert p["worker"]["node"] == p["proxy"]["node"]  # a worker beside its proxy
        assert p["proxy"]["address"].startswith(p["proxy"]["node"] + ":")
    assert doc["gateway"]["node"] == ray_cluster.ip(1) == doc["router"]["node"]
    pairs = _admin(doc["gateway"]["url"], "/admin/pairs")["pairs"]
    assert sorted(p["proxy_id"] for p in pairs) == ["proxy-0", "proxy-1"]
    assert all(p["health"] == "healthy" for p in pairs), pairs
    r = svc("agent", "status", "--service", SERVICE)
    assert r.returncode == 0 and ray_cluster.ip(2) in r.stdout and "NODE" in r.stdout


def test_sessions_on_both_nodes_with_the_sdk(svc):
    url = svc.status()["gateway"]["url"]
    with httpx.Client(timeout=30) as h:
        for i in range(4):  # new sessions by load: two on each pair
            s = h.post(
                url + "/v1/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
            )
            assert s.status_code == 201, s.text
            key = s.json()["session_api_key"]
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=30, max_retries=0)
            text = f"hello agent world {i}"
            assert client.responses.create(model="agent", input=text).output_text == text
            chat = client.chat.completions.create(
                model="agent", messages=[{"role": "user", "content": "second turn"}]
            )
            assert chat.choices[0].message.content == "second turn"
            streamed = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(
                    model="agent",
                    messages=[{"role": "user", "content": "one two three"}],
                    stream=True,
                )
                if chunk.choices
            )
            assert streamed == "one two three"
    pairs = _admin(url, "/admin/pairs")["pairs"]
    assert all(p["sessions"] > 0 for p in pairs), pairs  # both nodes served sessions


def test_logs_of_a_remote_worker(svc):
    r = svc("agent", "logs", "--service", SERVICE, "--component", "worker-1", "-n", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), "no log lines came back from the node"


def test_stop_force_leaves_nothing_on_any_node(svc, ray_cluster):
    # `stop --force` here (the inf e2e stops gracefully): SIGKILL through the hosts, then
    # the actors and the placement group go.
    r = svc("agent", "stop", "--service", SERVICE, "--force")
    assert r.returncode == 0, r.stderr
    for i in (1, 2):
        left = [p for p in ray_cluster.pids_in_node(i) if _ours(p)]
        assert not left, f"node {i}: {left}"
    doc = _named(ray_cluster)
    assert not [a for a in doc["actors"] if a["name"].startswith(f"areal-agent-{SERVICE}-")]
    assert not [p for p in doc["pgs"] if p.startswith(f"areal-agent-{SERVICE}-")]


def test_bad_agent_fails_with_its_message_and_leaves_nothing(ray_cluster, tmp_path):
    cli = Cli(ray_cluster, tmp_path / "home")
    r = cli(
        "agent", "run",
        "--service", "raybad",
        "--agent", "examples.agents.nope.NoSuchAgent",
        "--scheduler", "ray",
        "--num-pairs", "2",
        timeout=180,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: worker-") and "could not load the agent on node" in last, last
    assert "No module named 'examples.agents.nope'" in last, last
    assert not (tmp_path / "home" / "agent" / "services" / "raybad.json").exists()
    for i in (1, 2):
        assert not [p for p in ray_cluster.pids_in_node(i) if _ours(p)], f"node {i}"
    doc = _named(ray_cluster)
    assert not [a for a in doc["actors"] if a["name"].startswith("areal-agent-raybad-")]
    assert not [p for p in doc["pgs"] if p.startswith("areal-agent-raybad-")]


def _named(ray_cluster) -> dict:
    """The cluster's named actors and live placement groups."""
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
    return json.loads(check.stdout.strip().splitlines()[-1])


def _ours(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(name in cmd for name in OURS)
