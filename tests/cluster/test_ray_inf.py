"""`areal inf run --scheduler ray` on a real two-node Ray cluster (one namespace per node).

The CLI runs on node 1 (a Ray driver needs its node's raylet), so do the gateway and the
router; `sglang:d2` puts one replica (the real CPU SGLang engine with tiny-parrot, and its
data proxy) on each node. The tests talk to the gateway over the bridge with the official
`openai` SDK, as a trainer on another machine would. The last test kills node 2 and
watches its replica come back on node 1.
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
PARROT = REPO / "models" / "tiny-parrot"
ADMIN_KEY = "areal-ray-test-admin-key"
SERVICE = "rayt"
MODEL = "tiny"

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


class Cli:
    """`areal` run inside node 1, with its own AREAL_HOME."""

    def __init__(self, cluster, home: Path) -> None:
        self.cluster = cluster
        self.home = home
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
        r = self("inf", "status", "--service", SERVICE, "--json")
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


def _ours(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"sglang" in cmd or b"areal-proxy" in cmd
