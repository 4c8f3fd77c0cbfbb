"""Graceful drain on real engines: `areal inf deregister --replica R` under load loses no
request.

The service is the user's: `areal inf run --model tiny --backend sglang:d2 --detach` (two CPU
SGLang engines with tiny-parrot). One RL group of 8 sessions is pinned to one proxy P; each
has a short first turn, then a long second turn in flight on P's engine (4 streams, 4 whole
answers, 200 tokens with `ignore_eos`, logprobs), while unpinned admin-key requests keep
coming. Then the operator runs `areal inf deregister --model-name tiny --replica <P's rank>
--drain-timeout 0`: what is on P's engine moves to the other replica Q with its tokens, P's
engine is stopped, P stays to serve its sessions. Then:

* the 8 finish normally, the text each client got is its recorded output decoded (no token
  lost or repeated at the seam), and the rows name P, then Q;
* every unpinned request succeeded (none failed during the drain);
* each session's third turn (after the drain, still pinned to P) succeeds, made by Q;
* the group's export (with removal) holds all 24 interactions exactly once;
* P's engine's process group is gone, P's proxy is alive and listed as draining/retired.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from cli_service import Areal, group_alive, parrot_d2, sglang_missing
from migration_calls import MAX_TOKENS, MODEL, Call, messages_of, output, run_call
from testpaths import PARROT
from tokenizers import Tokenizer

from areal_cli.supervisor import Component

ADMIN_KEY = "drain-admin-key"
STREAMS = 4
WHOLE = 4

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(sglang_missing(), reason="no SGLang engine installed"),
]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with parrot_d2(tmp_path_factory.mktemp("home"), MODEL, ADMIN_KEY) as running:
        yield running


@dataclass
class Outcome:
    proxy: str  # P, retired
    other: str  # Q
    rank: str
    deregister: Any  # the CLI's CompletedProcess
    engine_pgid: int
    calls: list[Call]
    firsts: dict[str, tuple[str, str]]  # session id -> (interaction id, answer)
    thirds: list[httpx.Response]
    unpinned: list[int]  # statuses of the admin-key requests sent during the drain
    rows: list[dict[str, Any]]
    ack: dict[str, Any]
    workers: list[dict[str, Any]]
    models: dict[str, Any]
    components: dict[str, Any]


async def _unpinned_load(client: httpx.AsyncClient, stop: asyncio.Event, out: list[int]) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    while not stop.is_set():
        r = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers=admin,
        )
        out.append(r.status_code)


async def _scenario(a: Areal, url: str) -> Outcome:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        r = await client.post(
            "/rl/start_session",
            json={"task_id": "drain", "group_size": STREAMS + WHOLE},
            headers=admin,
        )
        assert r.status_code == 201, r.text
        group = r.json()
        sessions = group["sessions"]
        r = await client.get("/admin/models", headers=admin)
        [model] = [m for m in r.json()["models"] if m["name"] == MODEL]
        [proxy] = [w["proxy_id"] for w in model["workers"] if w.get("sessions")]
        [other] = [w["proxy_id"] for w in model["workers"] if w["proxy_id"] != proxy]

        async def turn(s: dict[str, str], messages: list[dict[str, str]]) -> httpx.Response:
            return await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0},
                headers={"Authorization": f"Bearer {s['session_api_key']}"},
            )

        firsts: dict[str, tuple[str, str]] = {}
        for s in sessions:
            r = await turn(s, messages_of(s["session_id"], "")[:1])
            assert r.status_code == 200, r.text
            firsts[s["session_id"]] = (r.json()["id"], r.json()["choices"][0]["message"]["content"])
        rank = proxy.rsplit("-", 1)[1]
        pgid = (await asyncio.to_thread(a.status))["components"][f"{MODEL}-worker-{rank}"]["pgid"]

        kinds = ["stream"] * STREAMS + ["whole"] * WHOLE
        calls = [Call(s, k) for s, k in zip(sessions, kinds, strict=True)]
        tasks = [
            asyncio.create_task(run_call(client, c, firsts[c.session["session_id"]][1]))
            for c in calls
        ]
        await asyncio.wait_for(asyncio.gather(*(c.started.wait() for c in calls)), 120)
        for c in calls:
            if c.kind == "stream":
                assert c.error is None and c.finish() is None, (c.kind, c.status, c.error)
        stop, unpinned = asyncio.Event(), []
        load = asyncio.create_task(_unpinned_load(client, stop, unpinned))
        deregister = await asyncio.to_thread(
            a, "inf", "deregister", "--model-name", MODEL, "--replica", rank,
            "--drain-timeout", "0", timeout=300,
        )  # fmt: skip
        await asyncio.wait_for(asyncio.gather(*tasks), 240)

        # The sessions go on, pinned to the retired P: their turns are made on Q.
        thirds = []
        for c in calls:
            sid = c.session["session_id"]
            history = [
                *messages_of(sid, firsts[sid][1]),
                {"role": "assistant", "content": c.content()},
                {"role": "user", "content": "and once more"},
            ]
            thirds.append(await turn(c.session, history))
        await asyncio.sleep(0.5)
        stop.set()
        await load

        for i, c in enumerate(calls):
            key = {"Authorization": f"Bearer {c.session['session_api_key']}"}
            r = await client.post("/rl/set_reward", json={"reward": float(i + 1)}, headers=key)
            assert r.status_code == 200, r.text
        r = await client.post(
            "/rl/export_trajectories",
            json={"group_id": group["group_id"], "style": "individual", "remove_session": True},
            headers=admin,
        )
        assert r.status_code == 200, r.text
        doc = r.json()
        r = await client.post("/rl/ack_export", json={"export_id": doc["export_id"]}, headers=admin)
        assert r.status_code == 200, r.text
        ack = r.json()
        workers = (await client.get("/admin/workers", headers=admin)).json()["workers"]
    models = await asyncio.to_thread(a, "inf", "models", "--json", timeout=60)
    return Outcome(
        proxy, other, rank, deregister, pgid, calls, firsts, thirds, unpinned, doc["rows"], ack,
        workers, json.loads(models.stdout), a.components(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def outcome(service) -> Outcome:
    a, url = service
    return asyncio.run(_scenario(a, url))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(PARROT / "tokenizer.json"))


def _row(o: Outcome, interaction_id: str) -> dict[str, Any]:
    [row] = [r for r in o.rows if r["interaction_id"] == interaction_id]
    return row


def test_the_cli_drains_the_replica_and_says_what_moved(outcome):
    r = outcome.deregister
    assert r.returncode == 0, r.stderr
    m = re.search(
        r"(\d+) request\(s\) finished on its engine, (\d+) moved .*, (\d+) could not", r.stdout
    )
    assert m, r.stdout
    finished, moved, failed = map(int, m.groups())
    # The 8 long turns, and any unpinned request that was on the engine at that moment.
    assert failed == 0 and moved >= 1 and finished + moved >= STREAMS + WHOLE, r.stdout


def test_every_request_on_the_drained_engine_finishes_with_no_seam(outcome, tok):
    for c in outcome.calls:
        assert c.status == 200 and c.error is None, (c.kind, c.status, c.error)
        assert c.finish() == "length" and c.usage()["completion_tokens"] == MAX_TOKENS
        rid = c.body["id"] if c.kind == "whole" else c.chunks[0][1]["id"]
        start, ids, lps = output(_row(outcome, rid))
        assert len(ids) == MAX_TOKENS and lps == pytest.approx(c.logprobs(), abs=1e-4), c.kind
        assert c.content() == tok.decode(ids), c.kind
        runs = _row(outcome, rid)["replicas"]
        assert runs[0][0] == start and runs[-1][1] == outcome.other, runs
        if c.kind == "stream":
            assert [p for _, p in runs] == [outcome.proxy, outcome.other], runs


def test_unpinned_requests_never_failed_during_the_drain(outcome):
    assert outcome.unpinned, "no unpinned request was sent during the drain"
    assert set(outcome.unpinned) == {200}, outcome.unpinned


def test_sessions_pinned_to_the_retired_replica_go_on_on_the_other(outcome):
    for r in outcome.thirds:
        assert r.status_code == 200, r.text
        start, _, _ = output(_row(outcome, r.json()["id"]))
        assert _row(outcome, r.json()["id"])["replicas"] == [[start, outcome.other]]


def test_the_export_holds_every_interaction_once(outcome):
    o = outcome
    ids = [r["interaction_id"] for r in o.rows]
    assert len(ids) == len(set(ids)) == 3 * len(o.calls)
    assert o.ack["removed"] and not o.ack["kept"], o.ack
    for sid, (first_id, _) in o.firsts.items():
        assert _row(o, first_id)["session_id"] == sid


def test_the_engine_is_stopped_and_the_proxy_stays_retired(outcome):
    o = outcome
    assert not group_alive(o.engine_pgid)
    name = f"{MODEL}-data-proxy-{o.rank}"
    assert f"{MODEL}-worker-{o.rank}" not in o.components
    assert Component.from_dict(o.components[name]).alive()
    assert o.components[name]["argv"][-1] == "--retired"
    [w] = [w for w in o.workers if w["proxy_id"] == o.proxy]
    assert w["health"] == "draining", w
    [m] = [m for m in o.models["models"] if m["name"] == MODEL]
    assert {r["data_proxy"]: r["retired"] for r in m["replicas"]}[name] is True
