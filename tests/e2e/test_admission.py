"""Admission control on the real CPU engine: the rule through the gateway (429 shape and
Retry-After, consumed = exported and acknowledged, weight versions), the bounded wait, and a
proxy restart that leaves the count as it was. The rule's edges and concurrency are unit
tests (packages/areal-router/tests/test_admission.py); 1,000 starts against a bound of 64
while weights are updated is benchmarks/admission_load.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from stack import launch, proxy_argv, start_stack, wait_healthy
from testpaths import PARROT

from areal_cli import supervisor

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]
MODEL = "tiny-parrot"


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("admission"), sglang_engine.url, PARROT, n_proxies=1)
    yield s
    s.stop()


def start(c: httpx.Client, n: int = 1, wait_s: float = 0.0) -> httpx.Response:
    return c.post(
        "/rl/start_session", json={"model": MODEL, "group_size": n, "wait_s": wait_s}, timeout=60
    )


def admission(c: httpx.Client) -> dict:
    r = c.get(f"/admin/models/{MODEL}/admission")
    assert r.status_code == 200, r.text
    return r.json()


def refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == code
    assert int(r.headers["retry-after"]) >= 1
    assert "Retry-After" in err["message"]


def test_the_rule_through_the_gateway(stack, sglang_engine):
    with stack.admin() as c:
        # Off by default: no bound, capacity_left null.
        assert admission(c)["capacity_left"] is None
        r = c.put(
            f"/admin/models/{MODEL}/admission",
            json={"max_staleness": 0, "batch_size": 2, "max_concurrent_rollouts": 2},
        )
        assert r.status_code == 200, r.text
        assert r.json()["capacity_left"] == 2
        bad = c.put(f"/admin/models/{MODEL}/admission", json={"batch_size": None})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "batch_size"

        group = start(c, 2)
        assert group.status_code == 201, group.text
        refused(start(c), "capacity_exhausted")
        keys = [s["session_api_key"] for s in group.json()["sessions"]]
        # A real turn, then the session ends: it leaves the concurrency bound but keeps its
        # place in the staleness bound until the trainer has it.
        for key in keys:
            chat = c.post(
                "/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                },
            )
            assert chat.status_code == 200, chat.text
            end = c.post("/rl/end_session", headers={"Authorization": f"Bearer {key}"})
            assert end.status_code == 200, end.text
        st = admission(c)
        assert (st["running"], st["ended"], st["consumed"]) == (0, 2, 0)
        refused(start(c), "staleness_bound")

        # Exported without an ack consumes nothing; the ack does.
        exp = c.post(
            "/rl/export_trajectories",
            json={"group_id": group.json()["group_id"], "remove_session": True},
        )
        assert exp.status_code == 200, exp.text
        assert admission(c)["ended"] == 2
        ack = c.post("/rl/ack_export", json={"export_id": exp.json()["export_id"]})
        assert ack.status_code == 200 and len(ack.json()["removed"]) == 2
        st = admission(c)
        assert (st["running"], st["ended"], st["consumed"], st["capacity_left"]) == (0, 0, 2, 0)
        refused(start(c), "staleness_bound")

        # A bounded wait that nothing ends: refused after wait_s, not before.
        t0 = time.monotonic()
        refused(start(c, wait_s=1.0), "staleness_bound")
        assert time.monotonic() - t0 >= 0.9

        # A start waiting for room goes in as soon as the version rises.
        out: dict = {}
        waiter = threading.Thread(target=lambda: out.update(r=start(c, 2, wait_s=60)))
        waiter.start()
        deadline = time.monotonic() + 10
        while admission(c)["waiting"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert admission(c)["waiting"] == 1
        r = c.post("/admin/set_version", json={"model": MODEL, "version": 1})
        assert r.status_code == 200, r.text
        waiter.join(30)
        assert out["r"].status_code == 201, out["r"].text
        st = admission(c)
        assert (st["version"], st["running"], st["consumed"], st["capacity_left"]) == (1, 2, 2, 0)


def test_the_count_survives_a_proxy_restart(stack, sglang_engine):
    with stack.admin() as c:
        before = admission(c)
        assert before["running"] == 2  # the group the previous test started
        proxy = stack.proxies[0]
        port = proxy.info["port"]
        supervisor.terminate([[proxy.comp]], grace=5, procs={proxy.popen.pid: proxy.popen})
        argv = proxy_argv(stack, sglang_engine.url, MODEL, PARROT, 0, [], port=port)
        stack.proxies[0] = launch(proxy.comp.name, argv, stack.log_dir, stack.env)
        wait_healthy(stack, MODEL, 1)
        after = admission(c)
        keep = ("version", "running", "ended", "consumed", "capacity_left")
        assert {k: after[k] for k in keep} == {k: before[k] for k in keep}
        refused(start(c), "capacity_exhausted")
        # Removing the bounds lets every start in again (the default).
        r = c.put(
            f"/admin/models/{MODEL}/admission",
            json={"max_staleness": None, "batch_size": None, "max_concurrent_rollouts": None},
        )
        assert r.status_code == 200 and r.json()["capacity_left"] is None
        assert start(c).status_code == 201
