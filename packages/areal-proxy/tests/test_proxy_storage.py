"""A full disk under the proxy's session database: a clear 507 naming storage, nothing lost,
and recovery once there is space again. Through the real ProxyServer (gRPC on loopback).

The disk is a real one: a 512 KiB tmpfs holding the database, filled by a file that takes
every free block, so SQLite sees ENOSPC exactly as on a full volume (mounting needs root; the
test is skipped without it). The store-level test reaches the same error with `PRAGMA
max_page_count` (SQLite's own "database or disk is full"), which runs anywhere.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import grpc
import orjson
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, start

from areal_proto.common.v1 import envelope_pb2
from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.common.records import Interaction, Session
from areal_proxy.recording.store import Store
from areal_runtime.errors import StorageFull
from areal_runtime.session_keys import mint_key, new_id

ADMIN = envelope_pb2.Envelope(api_key="admin", is_admin=True)


class TmpfsDisk:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.filler = root / "filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as e:
            assert e.errno == 28  # ENOSPC: the disk is full
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def disk(tmp_path):
    root = tmp_path / "disk"
    root.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("mounting a small tmpfs needs root (the store-level test below still runs)")
    try:
        yield TmpfsDisk(root)
    finally:
        if mounted:
            subprocess.run(["umount", str(root)], check=False)


async def _start_session(h, group: str):
    sid = new_id("sess")
    key = mint_key(sid)
    await h.stub.StartSessions(
        proxy_pb2.StartSessionsRequest(
            task_id="t",
            group_id=group,
            sessions=[proxy_pb2.SessionCredentials(session_id=sid, session_api_key=key)],
        )
    )
    return sid, key


def _is_storage_full(exc: grpc.aio.AioRpcError) -> None:
    d = error_detail(exc)
    assert (d.http_status, d.code, d.type) == (507, "storage_full", "storage_error"), d
    assert "storage is full" in d.message
    # Every caller gets this error, session-key holders included: no path of the machine.
    assert "sqlite" not in d.message and "/" not in d.message, d.message
    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def _export(h, group: str, remove_session: bool = False, export_id: str = "") -> list[dict]:
    rows = []
    async for chunk in h.stub.ExportTrajectories(
        proxy_pb2.ExportTrajectoriesRequest(
            group_id=group,
            style="individual",
            discount=1.0,
            envelope=ADMIN,
            remove_session=remove_session,
            export_id=export_id,
        )
    ):
        rows.extend(orjson.loads(line) for line in chunk.jsonl.splitlines())
    return rows


async def test_full_disk_is_507_nothing_lost_and_recovers(disk):
    h = await start(FakeEngineClient([5, 6, EOS]), db_path=str(disk.root / "proxy.sqlite"))
    store = h.server.store
    try:
        sid, key = await _start_session(h, "g1")
        msgs = {"messages": [{"role": "user", "content": "hi " * 200}], "max_tokens": 3}
        first = await h.chat(msgs, api_key=key, session_id=sid)
        disk.fill()

        # Starting a session is a 507 naming storage (it used to be 409 session_exists).
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _start_session(h, "g2")
        _is_storage_full(info.value)
        # A chat that cannot be recorded is not acknowledged: 507, whole or streamed.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.chat(msgs, api_key=key, session_id=sid)
        _is_storage_full(info.value)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.chat_stream({**msgs, "stream": True}, api_key=key, session_id=sid)
        _is_storage_full(info.value)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.SetReward(
                proxy_pb2.SetRewardRequest(session_id=sid, reward=1.0, envelope=ADMIN)
            )
        _is_storage_full(info.value)
        # An export that claims its sessions (remove_session) writes its claim: the same
        # 507 on a full disk, also as the proxy's first claim ever (the claims table is
        # created then: it was a 500 internal_error until a claim had once succeeded).
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _export(h, "g1", remove_session=True, export_id="exp-1")
        _is_storage_full(info.value)
        # Reading needs no space, and the proxy stays up.
        assert [r["interaction_id"] for r in await _export(h, "g1")] == [first["id"]]
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.sessions == 1

        disk.free()
        again = await h.chat(msgs, api_key=key, session_id=sid)
        await h.stub.SetReward(
            proxy_pb2.SetRewardRequest(session_id=sid, reward=1.0, envelope=ADMIN)
        )
        sid2, key2 = await _start_session(h, "g2")
        await h.chat(msgs, api_key=key2, session_id=sid2)
        rows = await _export(h, "g1")
        # Everything acknowledged is there, in order; nothing refused left a trace.
        assert [r["interaction_id"] for r in rows] == [first["id"], again["id"]]
        assert [r["reward"] for r in rows] == [1.0, 1.0]  # discount 1: walked back
        assert store.interaction_count() == 3
    finally:
        await h.close()


async def test_a_reused_session_id_is_still_409(tmp_path):
    h = await start(FakeEngineClient([5, EOS]), db_path=str(tmp_path / "p.sqlite"))
    try:
        sid = new_id("sess")
        creds = [proxy_pb2.SessionCredentials(session_id=sid, session_api_key=mint_key(sid))]
        req = proxy_pb2.StartSessionsRequest(task_id="t", group_id="g", sessions=creds)
        await h.stub.StartSessions(req)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.StartSessions(req)
        d = error_detail(info.value)
        assert (d.http_status, d.code) == (409, "session_exists")
    finally:
        await h.close()


def test_store_full_database_is_storage_full_and_recovers(tmp_path):
    store = Store(tmp_path / "p.sqlite")
    now = time.time()
    store.add_sessions([Session("s1", "g", "t", "h", "m", now, now)])
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")

    def turn(seq: int) -> Interaction:
        ids = list(range(20_000))  # 80 kB of ids: new pages
        return Interaction(f"i{seq}", "s1", seq, [], {}, ids, [1], [0.0], [0], "stop")

    with pytest.raises(StorageFull, match="storage is full"):
        store.add_interaction(turn(0))
    with pytest.raises(StorageFull):
        store.add_sessions([Session("s2", "g", "t", "x" * 100_000, "m", now, now)])
    assert store.interaction_count() == 0 and store.session("s1").n_interactions == 0
    store._db.execute("PRAGMA max_page_count = 1073741823")
    store.add_interaction(turn(0))
    assert store.interaction("i0") is not None
