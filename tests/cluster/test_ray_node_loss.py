"""Losing a node under RL load: the replica Ray places again on the surviving node, the
service heals without operator action, and with `[scheduler] shared_dir` no acknowledged
interaction is lost.

Prints one row like benchmarks/fault_table.py's: errors seen, seconds to healthy, lost.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import openai
import pytest
from test_ray_inf import ADMIN_KEY, MODEL, PARROT, Cli

SERVICE = "rayloss"

pytestmark = [pytest.mark.cluster, pytest.mark.engine]


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory):
    home = tmp_path_factory.mktemp("areal-home")
    shared = tmp_path_factory.mktemp("shared")
    (home / "inf").mkdir(mode=0o700)
    (home / "inf" / "config.toml").write_text(f'[scheduler]\nshared_dir = "{shared}"\n')
    cli = Cli(ray_cluster, home, SERVICE)
    r = cli(
        "inf", "run",
        "--service", SERVICE,
        "--scheduler", "ray",
        "--host", ray_cluster.ip(1),
        "--port", "18081",
        "--admin-api-key", ADMIN_KEY,
        "--model", MODEL,
        "--backend", "sglang:d2",
        "--model-path", str(PARROT),
        "--proxy-args", "--request-timeout 60 --chat-template-type hf",
        "--detach",
        timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    yield cli
    cli("inf", "stop", "--service", SERVICE, "--force", timeout=120)


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
    ray_cluster.start_node(2)  # the session's cluster stays whole for the tests after this
