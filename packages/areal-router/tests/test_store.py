"""The SQLite state store: migration, file modes, cost per change, group commit, pin TTL."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import threading
import time

import pytest

from areal_router.registry import EXTERNAL, ModelState, Registry
from areal_router.server import sweep_interval
from areal_router.store import SQLITE_MAGIC, StateStore, read_state


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _written_bytes() -> int:
    """Bytes this process handed to write(2) so far (every thread)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_a_json_state_of_an_older_router_is_migrated_once(tmp_path):
    path = tmp_path / "router-state.json"
    old = {
        "format": 1,
        "models": [
            {
                "name": "m",
                "kind": 1,
                "base_url": "",
                "api_key": "",
                "upstream_model": "",
                "created_unix_s": 5,
                "implicit": False,
            },
            {
                "name": "ext",
                "kind": EXTERNAL,
                "base_url": "http://u/v1",
                "api_key": "sk-1",
                "upstream_model": "up",
                "created_unix_s": 6,
                "implicit": False,
            },
        ],
        "proxies": [
            {"proxy_id": "p1", "address": "127.0.0.1:2", "model": "m", "kind": 1, "labels": {}},
            {"proxy_id": "p0", "address": "127.0.0.1:1", "model": "m", "kind": 2, "labels": {}},
        ],
        "pins": {"s0": "p0", "s1": "p1", "group:g": "p0"},
    }
    path.write_text(json.dumps(old))
    os.chmod(path, 0o600)
    reg = Registry(pin_ttl=3600)
    store = StateStore(path, reg)
    assert store.load()
    assert path.read_bytes().startswith(SQLITE_MAGIC)  # the file itself is the new store
    assert _mode(path) == 0o600
    migrated = reg.to_json()
    migrated["models"].sort(key=lambda m: m["name"] != "m")  # model order means nothing
    assert migrated == old  # nothing lost, proxies in their order
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no migration leftovers
    reg.unpin(["s1"])
    await store.close()
    # Next start: read from SQLite, not migrated again.
    again = Registry(pin_ttl=3600)
    assert StateStore(path, again).load()
    assert again.pins == {"s0": "p0", "group:g": "p0"}
    assert again.models["ext"].api_key == "sk-1" and again.models["m"].proxy_ids == ["p1", "p0"]


async def test_files_are_private_and_new_folders_0700(tmp_path):
    path = tmp_path / "a" / "b" / "router-state.db"
    reg = Registry()
    store = StateStore(path, reg)
    assert not store.load()
    reg.add_model(ModelState(name="m"))
    await store.flush()
    for p in (path, f"{path}-wal", f"{path}-shm"):
        assert _mode(p) == 0o600, p
    assert _mode(tmp_path / "a") == _mode(tmp_path / "a" / "b") == 0o700
    await store.close()


async def test_a_change_costs_the_same_with_many_sessions_pinned(tmp_path):
    """One pin among 20,000 writes a few pages, not every pin again (the JSON file was
    rewritten whole: about 1 MB here, per change)."""
    path = tmp_path / "state.db"
    reg = Registry()
    store = StateStore(path, reg)
    store.load()
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    for i in range(0, 20_000, 1000):
        reg.pin([f"sess-{j:06d}" for j in range(i, i + 1000)], p)
        await store.flush()
    costs = []
    for i in range(5):
        before = _written_bytes()
        reg.pin([f"group:new-{i}", f"new-{i}"], p)
        await store.flush()
        costs.append(_written_bytes() - before)
    assert max(costs) < 64 * 1024, costs
    assert read_state(path)["pins"]["new-4"] == "p0"
    await store.close()


async def test_concurrent_changes_share_commits_and_each_waits_for_its_own(tmp_path):
    path = tmp_path / "state.db"
    reg = Registry()
    store = StateStore(path, reg)
    store.load()
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    await store.flush()
    commits = store.commits
    # A slow disk: each commit takes 50 ms.
    real_commit = store._commit
    in_commit = threading.Event()

    def slow(batch):
        in_commit.set()
        time.sleep(0.05)
        real_commit(batch)

    store._commit = slow  # type: ignore[method-assign]

    async def bind(i: int) -> None:
        reg.pin([f"s{i}"], p)
        await store.flush()
        # Acknowledged means committed: another connection sees it.
        assert read_state(path)["pins"][f"s{i}"] == "p0"

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    tick = asyncio.create_task(ticker())
    await asyncio.gather(*(bind(i) for i in range(50)))
    tick.cancel()
    assert in_commit.is_set()
    # 50 changes, made while commits were running, need only a few commits.
    assert store.commits - commits <= 3, store.commits - commits
    # The loop kept running while the commits slept on their thread.
    assert ticks >= 5
    await store.close()


async def test_a_failed_commit_fails_its_callers_and_is_written_by_the_next(tmp_path):
    path = tmp_path / "state.db"
    reg = Registry()
    store = StateStore(path, reg)
    store.load()
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    real_commit = store._commit

    def broken(batch):
        raise OSError("disk full")

    store._commit = broken  # type: ignore[method-assign]
    reg.pin(["s0"], p)
    with pytest.raises(OSError, match="disk full"):
        await store.flush()
    store._commit = real_commit  # type: ignore[method-assign]
    assert store.dirty  # not forgotten
    await store.flush()
    assert read_state(path)["pins"] == {"s0": "p0"}
    await store.close()


async def test_a_deleted_state_does_not_come_back_from_its_wal(tmp_path):
    """`areal inf run` deletes only the state file when it starts a new service; a router
    killed earlier left its -wal beside it. SQLite ignores a -wal beside an empty database
    (its header is not in WAL mode), so the old state does not come back."""
    live = tmp_path / "live"
    live.mkdir()
    path = live / "state.db"
    reg = Registry()
    store = StateStore(path, reg)
    store.load()
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    reg.pin(["s0"], p)
    await store.flush()
    # What a SIGKILL leaves: the files as they are while the router runs.
    dead = tmp_path / "dead"
    dead.mkdir()
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(f"{path}{suffix}", dead / f"state.db{suffix}")
    await store.close()
    assert read_state(dead / "state.db")["pins"] == {"s0": "p0"}  # the copy is a real state
    (dead / "state.db").unlink()
    fresh = Registry()
    store = StateStore(dead / "state.db", fresh)
    assert not store.load()
    assert fresh.proxies == {} and fresh.pins == {}
    # What the new router writes next is all the file holds (no old frame mixed in).
    q, _ = fresh.upsert_proxy("q0", "127.0.0.1:2", "n")
    fresh.pin(["t0"], q)
    await store.close()
    state = read_state(dead / "state.db")
    assert state["pins"] == {"t0": "q0"} and [p["proxy_id"] for p in state["proxies"]] == ["q0"]


def test_a_file_that_is_not_a_state_is_refused_and_kept(tmp_path):
    path = tmp_path / "state.db"
    garbage = SQLITE_MAGIC + b"\xff" * 200
    path.write_bytes(garbage)
    with pytest.raises(ValueError, match="not a router state"):
        StateStore(path, Registry()).load()
    assert path.read_bytes() == garbage


# -- pin TTL -----------------------------------------------------------------


def test_pins_expire_after_their_last_use_in_lru_order():
    clock = Clock()
    reg = Registry(pin_ttl=100.0, clock=clock)
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    reg.pin(["a", "group:g"], p)
    clock.t += 10
    reg.pin(["b"], p)
    clock.t += 50
    reg.touch("a")  # used: a's 100 s start again
    reg.touch("nope")  # not pinned: nothing
    reg.dirty_pins.clear()
    clock.t += 0.5
    reg.touch("a")  # within the granularity (1 s): no new write
    assert not reg.dirty_pins
    clock.t += 45  # 105.5 s after the bind of group:g, 95.5 after b's, 45.5 after a's use
    assert reg.expire() == ["group:g"]
    assert set(reg.pins) == {"a", "b"} and p.sessions == {"a", "b"}
    assert reg.dirty_pins == {"group:g"}  # its delete goes to the store
    clock.t += 5
    assert reg.expire() == ["b"]
    clock.t += 100
    assert reg.expire() == ["a"] and reg.pins == {}
    assert Registry(pin_ttl=0).expire() == []


def test_a_group_pin_lives_while_its_sessions_are_used():
    clock = Clock()
    reg = Registry(pin_ttl=100.0, clock=clock)
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    reg.pin(["group:g", "a", "b"], p)
    for _ in range(5):
        clock.t += 60
        reg.touch("a")  # a works for 300 s; nothing routes by the group pin meanwhile
    assert reg.expire() == ["b"]  # b idle for 300 s
    assert set(reg.pins) == {"group:g", "a"}  # the group can still be exported by its id
    clock.t += 101
    assert sorted(reg.expire()) == ["a", "group:g"]


async def test_last_use_is_stored_and_expired_pins_never_serve_after_a_restart(tmp_path):
    path = tmp_path / "state.db"
    clock = Clock()
    reg = Registry(pin_ttl=100.0, clock=clock)
    store = StateStore(path, reg)
    store.load()
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    reg.pin(["old"], p)
    reg.pin(["used"], p)
    clock.t += 60
    reg.touch("used")
    await store.close()
    assert read_state(path)["pin_used"] == {"old": 1_000_000.0, "used": 1_000_060.0}
    clock.t += 50  # "old" expired while the router was down
    again = Registry(pin_ttl=100.0, clock=clock)
    store = StateStore(path, again)
    store.load()
    assert list(again.pin_used) == ["old", "used"]  # least recently used first
    assert again.expire() == ["old"]
    await store.flush()
    assert read_state(path)["pins"] == {"used": "p0"}
    await store.close()


def test_sweep_interval():
    assert sweep_interval(86400) == 60.0
    assert sweep_interval(10) == 1.0
    assert sweep_interval(0.1) == 0.05


def test_pin_ttl_flag():
    from areal_router.settings import RouterSettings, parse

    assert parse([]).pin_ttl == 86400.0
    assert parse(["--pin-ttl", "0"]).pin_ttl == 0.0
    with pytest.raises(ValueError):
        RouterSettings(pin_ttl=-1)


# -- a group's pins end together -------------------------------------------------


async def test_releasing_a_group_pin_with_bound_releases_its_sessions_after_a_restart(tmp_path):
    path = tmp_path / "state.db"
    reg = Registry()
    store = StateStore(path, reg)
    store.load()
    p, _ = reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    q, _ = reg.upsert_proxy("p1", "127.0.0.1:2", "m")
    reg.pin(["group:g", "a", "b", "c"], p)
    reg.pin(["group:h", "d"], p)
    reg.pin(["c"], q)  # bound again since: no longer the group's
    await store.close()
    assert read_state(path)["bound_by"] == {
        "group:g": "group:g",
        "a": "group:g",
        "b": "group:g",
        "group:h": "group:h",
        "d": "group:h",
    }
    again = Registry()
    store = StateStore(path, again)
    store.load()
    assert again.unpin(["a"], with_bound=True) == 1  # not the bind's first id: only itself
    assert again.unpin(["group:g"], with_bound=True) == 2  # the group pin and b
    assert again.pins == {"c": "p1", "group:h": "p0", "d": "p0"}
    assert again.unpin(["group:h"]) == 1  # without with_bound: only the group pin
    assert again.unpin(["group:h"], with_bound=True) == 1  # its sessions still go with it
    assert again.pins == {"c": "p1"} and again.bundles == {}
    await store.flush()
    assert read_state(path)["pins"] == {"c": "p1"}
    await store.close()
