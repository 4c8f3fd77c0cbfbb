"""Two gateways on one port, on a real engine: any gateway serves any request, and a gateway
killed under RL load costs no acknowledged interaction.

The service is the user's: `areal inf run --model tiny --model-path tiny-parrot --gateways 2
--detach` (one CPU SGLang engine, supervision on). Each gateway also answers on a loopback
port of its own (`status --json`: `own_url`), which lets the test pick a gateway.

* Crossing: a group started through gateway A; each session's turns alternate A and B, its
  reward is set through either, the export is taken through B and acknowledged through A; a
  stored Response made through A is continued through B, read back through A, deleted
  through B.
* Killed under load: 8 clients run turns of 16 sessions on the shared port (keep-alive
  connections, a retry on a failed request, as an RL rollout client does); gateway A gets
  `kill -9` mid-run. The port keeps serving through B, the watchdog restarts A on it, and
  the group's export holds every interaction a client got a 200 for, exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from cli_service import Areal, cli_service, sglang_missing
from testpaths import PARROT

MODEL = "tiny"
ADMIN_KEY = "gateways-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CLIENTS = 8
SESSIONS = 16

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(sglang_missing(), reason="no SGLang engine installed"),
]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with cli_service(
        tmp_path_factory.mktemp("home"),
        "--model", MODEL,
        "--model-path", str(PARROT),
        "--gateways", "2",
        "--admin-api-key", ADMIN_KEY,
    ) as running:  # fmt: skip
        yield running


def gateways(a: Areal) -> dict[str, dict[str, Any]]:
    comps = a.status()["components"]
    return {n: c for n, c in comps.items() if c["role"] == "gateway"}


def chat(key: str, content: str) -> dict[str, Any]:
    return {
        "json": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 6,
            "temperature": 0,
        },
        "headers": {"Authorization": f"Bearer {key}"},
    }


async def export(client: httpx.AsyncClient, group_id: str) -> dict[str, Any]:
    r = await client.post(
        "/rl/export_trajectories",
        json={"group_id": group_id, "style": "individual", "remove_session": True},
        headers=ADMIN,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_rewards_and_exports_cross_gateways(service):
    a, _ = service
    ga, gb = (g["own_url"] for g in gateways(a).values())

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(base_url=ga, timeout=120) as A,
            httpx.AsyncClient(base_url=gb, timeout=120) as B,
        ):
            for c in (A, B):  # a model registered through one is served by all
                r = await c.get("/v1/models", headers=ADMIN)
                assert MODEL in [m["id"] for m in r.json()["data"]], r.text
            r = await A.post(
                "/rl/start_session", json={"task_id": "cross", "group_size": 4}, headers=ADMIN
            )
            assert r.status_code == 201, r.text
            group = r.json()
            made: dict[str, list[str]] = {}
            for i, s in enumerate(group["sessions"]):
                key = s["session_api_key"]
                ids = []
                for turn, c in enumerate((A, B)):
                    r = await c.post("/v1/chat/completions", **chat(key, f"s{i} t{turn}"))
                    assert r.status_code == 200, r.text
                    ids.append(r.json()["id"])
                made[s["session_id"]] = ids
                r = await (A, B)[i % 2].post(
                    "/rl/set_reward",
                    json={"reward": float(i)},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert r.status_code == 200, r.text
            doc = await export(B, group["group_id"])
            r = await A.post("/rl/ack_export", json={"export_id": doc["export_id"]}, headers=ADMIN)
            assert r.status_code == 200, r.text
            assert r.json()["removed"], r.json()
            # A stored response continues, and reads back, through the other gateway.
            first = await A.post(
                "/v1/responses",
                json={"model": MODEL, "input": "one", "max_output_tokens": 4},
                headers=ADMIN,
            )
            assert first.status_code == 200, first.text
            rid = first.json()["id"]
            second = await B.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "input": "two",
                    "previous_response_id": rid,
                    "max_output_tokens": 4,
                },
                headers=ADMIN,
            )
            assert second.status_code == 200, second.text
            got = await A.get(f"/v1/responses/{second.json()['id']}", headers=ADMIN)
            assert got.status_code == 200 and got.json()["id"] == second.json()["id"], got.text
            assert (await B.delete(f"/v1/responses/{rid}", headers=ADMIN)).status_code == 200
            assert (await A.get(f"/v1/responses/{rid}", headers=ADMIN)).status_code == 404
        rows = doc["rows"]
        assert sorted(r["interaction_id"] for r in rows) == sorted(
            i for ids in made.values() for i in ids
        )
        for r in rows:
            assert made[r["session_id"]].count(r["interaction_id"]) == 1

    asyncio.run(scenario())


@dataclass
class Load:
    acked: dict[str, str] = field(default_factory=dict)  # interaction id -> session id
    failed: int = 0  # attempts that got no 200 (then retried)
    acked_while_down: int = 0
    down: bool = False


async def _client(
    url: str, sessions: list[dict[str, str]], stop: asyncio.Event, load: Load
) -> None:
    n = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not stop.is_set():
            s = sessions[n % len(sessions)]
            n += 1
            for _attempt in range(5):
                try:
                    r = await client.post(
                        "/v1/chat/completions", **chat(s["session_api_key"], f"turn {n}")
                    )
                except httpx.TransportError:
                    load.failed += 1
                    continue
                if r.status_code != 200:
                    load.failed += 1
                    await asyncio.sleep(0.05)
                    continue
                load.acked[r.json()["id"]] = s["session_id"]
                load.acked_while_down += load.down
                break
            else:
                raise AssertionError(f"a turn failed 5 times: {r.status_code} {r.text}")


def test_a_gateway_killed_under_load_loses_no_acknowledged_interaction(service):
    a, url = service
    before = gateways(a)
    victim = before["gateway"]

    async def scenario() -> tuple[Load, list[dict[str, Any]], float]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as admin:
            r = await admin.post(
                "/rl/start_session",
                json={"task_id": "kill", "group_size": SESSIONS},
                headers=ADMIN,
            )
            assert r.status_code == 201, r.text
            group = r.json()
            sessions = group["sessions"]
            load, stop = Load(), asyncio.Event()
            tasks = [
                asyncio.create_task(_client(url, sessions[i::CLIENTS], stop, load))
                for i in range(CLIENTS)
            ]
            await asyncio.sleep(3.0)
            assert len(load.acked) > 0, "no turn acknowledged before the kill"
            os.kill(victim["pid"], signal.SIGKILL)
            load.down = True
            t0 = time.monotonic()

            def restarted() -> bool:
                g = gateways(a)["gateway"]
                return g["pid"] != victim["pid"] and g["state"] == "running" and g["healthy"]

            while not await asyncio.to_thread(restarted):
                assert time.monotonic() - t0 < 60, "the killed gateway was not restarted"
                await asyncio.sleep(0.5)
            back_in = time.monotonic() - t0
            load.down = False
            await asyncio.sleep(2.0)  # and the restarted one serves its share again
            stop.set()
            await asyncio.gather(*tasks)
            for s in sessions:
                r = await admin.post(
                    "/rl/set_reward",
                    json={"reward": 1.0},
                    headers={"Authorization": f"Bearer {s['session_api_key']}"},
                )
                assert r.status_code == 200, r.text
            doc = await export(admin, group["group_id"])
        return load, doc["rows"], back_in

    load, rows, back_in = asyncio.run(scenario())
    exported = [r["interaction_id"] for r in rows]
    assert len(exported) == len(set(exported)), "an interaction was exported twice"
    lost = set(load.acked) - set(exported)
    assert not lost, f"{len(lost)} of {len(load.acked)} acknowledged interactions not exported"
    assert load.acked_while_down > 0, "nothing was served while one gateway was down"
    after = gateways(a)
    assert (
        after["gateway"]["restarts"] == 1
        and after["gateway-1"]["pid"] == before["gateway-1"]["pid"]
    ), "the other gateway must not have been touched"
    print(
        f"\nacknowledged {len(load.acked)}, retried {load.failed}, served while down "
        f"{load.acked_while_down}, restarted in {back_in:.1f}s, exported {len(exported)}"
    )
