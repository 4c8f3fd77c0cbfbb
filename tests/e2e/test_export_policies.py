"""Staleness as data and groups that survive failures, end to end (real SGLang, CPU).

One group of four sessions through the gateway: two members chat at weight version 0, two at
version 2, one of those ends with a failure reason; the service is then at version 3. Every
exported row carries its versions and staleness; the export's staleness bound drops or marks,
its group policies keep or drop the group; the answer's summary and the proxy's metrics count
what was held back. Versions are moved with /admin/set_version (the tiny parrot's weights
stay), which is what the proxy stamps on every token it records.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from stack import ADMIN_KEY, metric, start_stack
from testpaths import PARROT

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"
DROPPED_STALE = 'areal_proxy_export_rows_total{outcome="dropped_stale"}'


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("export-policies"), sglang_engine.url, PARROT, n_proxies=1
    )
    yield s
    with _admin(s) as c:
        c.post("/admin/set_version", json={"version": 0})
    s.stop()


def _admin(s) -> httpx.Client:
    return httpx.Client(
        base_url=s.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
    )


def _set_version(c: httpx.Client, v: int) -> None:
    r = c.post("/admin/set_version", json={"version": v})
    assert r.status_code == 200, r.text


def _chat(s, session) -> None:
    client = openai.OpenAI(
        base_url=s.gateway_url + "/v1", api_key=session["session_api_key"], max_retries=0
    )
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )


def _export(c: httpx.Client, group_id: str, **body) -> dict:
    r = c.post("/rl/export_trajectories", json={"group_id": group_id, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def group(stack):
    with _admin(stack) as c:
        _set_version(c, 0)
        r = c.post("/rl/start_session", json={"task_id": "t", "group_size": 4})
        assert r.status_code == 201, r.text
        g = r.json()
        a, b, x, y = g["sessions"]
        _chat(stack, a)
        _chat(stack, b)
        _set_version(c, 2)
        _chat(stack, x)
        _chat(stack, y)
        # y failed (its harness saw the engine refuse): ended with why, by its own key.
        with httpx.Client(
            base_url=stack.gateway_url,
            headers={"Authorization": f"Bearer {y['session_api_key']}"},
            timeout=60,
        ) as own:
            bad = own.post("/rl/end_session", json={"failure": "Not a code!"})
            assert bad.status_code == 400, bad.text
            r = own.post("/rl/end_session", json={"failure": "engine_refusal"})
            assert r.status_code == 200 and r.json() == {"ended": 1}, r.text
        _set_version(c, 3)
    return g


def test_rows_carry_their_versions_and_staleness(stack, group) -> None:
    a, b, x, y = (s["session_id"] for s in group["sessions"])
    with _admin(stack) as c:
        doc = _export(c, group["group_id"])  # no bound: every row, as before
    by = {r["session_id"]: r for r in doc["rows"]}
    assert set(by) == {a, b, x, y}
    for sid, v in ((a, 0), (b, 0), (x, 2), (y, 2)):
        assert (by[sid]["min_version"], by[sid]["max_version"]) == (v, v)
        assert by[sid]["staleness"] == 3 - v and by[sid]["stale"] is False
    assert by[y]["failure"] == "engine_refusal" and by[a]["failure"] == ""
    summary = doc["summary"]
    assert summary["version"] == 3 and summary["exported"] == 4
    assert summary["staleness"] == {"1": 2, "3": 2}
    assert summary["failed"] == [
        {"session_id": y, "group_id": group["group_id"], "failure": "engine_refusal"}
    ]


def test_the_staleness_bound_drops_or_marks(stack, group) -> None:
    a, b, x, y = (s["session_id"] for s in group["sessions"])
    proxy = stack.proxies[0]
    dropped_before = metric(proxy, DROPPED_STALE)
    with _admin(stack) as c:
        doc = _export(c, group["group_id"], max_staleness=1)
        assert {r["session_id"] for r in doc["rows"]} == {x, y}
        assert (doc["summary"]["dropped_stale"], doc["summary"]["exported"]) == (2, 2)
        doc = _export(c, group["group_id"], max_staleness=1, stale="mark")
        stale = {r["session_id"]: r["stale"] for r in doc["rows"]}
        assert stale == {a: True, b: True, x: False, y: False}
        # A token older than the bound masked: the old rows keep no trainable token, dropped.
        doc = _export(c, group["group_id"], max_staleness=1, mask_stale_tokens=True)
        assert {r["session_id"] for r in doc["rows"]} == {x, y}
        assert doc["summary"]["masked_tokens"] > 0
        bad = c.post(
            "/rl/export_trajectories",
            json={"group_id": group["group_id"], "mask_stale_tokens": True},
        )
        assert bad.status_code == 400, bad.text
    # The proxy counted what its exports dropped (the mask export's two as well).
    assert metric(proxy, DROPPED_STALE) - dropped_before == 4
    body = httpx.get(f"http://127.0.0.1:{proxy.info['metrics_port']}/metrics", timeout=10).text
    assert "areal_proxy_export_row_staleness_bucket" in body


def test_group_policies_with_a_failed_member(stack, group) -> None:
    a, b, x, y = (s["session_id"] for s in group["sessions"])
    gid = group["group_id"]
    with _admin(stack) as c:
        # All or nothing: y failed, so nothing.
        doc = _export(c, gid, drop_incomplete_group=True)
        assert doc["rows"] == [] and doc["summary"]["dropped_groups"] == 1
        assert doc["summary"]["dropped_group_rows"] == 4
        # The usable members (all but y) when at least 3 are.
        doc = _export(c, gid, min_usable_group_size=3)
        assert {r["session_id"] for r in doc["rows"]} == {a, b, x}
        assert doc["summary"]["dropped_failed_rows"] == 1
        # With the bound, only x is usable: under 2, the group goes.
        doc = _export(c, gid, max_staleness=1, min_usable_group_size=2)
        assert doc["rows"] == [] and doc["summary"]["dropped_groups"] == 1
        both = c.post(
            "/rl/export_trajectories",
            json={"group_id": gid, "drop_incomplete_group": True, "min_usable_group_size": 2},
        )
        assert both.status_code == 400, both.text
        # Removal with a policy: the group's sessions go once acknowledged, dropped or not.
        doc = _export(c, gid, min_usable_group_size=3, remove_session=True)
        ack = c.post("/rl/ack_export", json={"export_id": doc["export_id"]})
        assert ack.status_code == 200 and sorted(ack.json()["removed"]) == sorted([a, b, x, y])
