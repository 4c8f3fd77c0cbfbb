"""Registry bookkeeping, health transitions and the state file."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from areal_proto.router.v1 import router_pb2
from areal_router.registry import (
    DRAINING,
    EXTERNAL,
    HEALTHY,
    INTERNAL,
    NOT_POLLED,
    UNHEALTHY,
    ModelState,
    Registry,
)
from areal_router.settings import RouterSettings, parse
from areal_router.store import StateStore
from areal_runtime.errors import ServiceError


def test_model_registration_rules():
    reg = Registry()
    reg.add_model(ModelState(name="m"))
    assert reg.models["m"].kind == INTERNAL and reg.models["m"].created_unix_s > 0
    with pytest.raises(ServiceError) as exc:
        reg.add_model(ModelState(name="m"))
    assert exc.value.http_status == 409
    with pytest.raises(ServiceError) as exc:
        reg.add_model(ModelState(name="x", kind=EXTERNAL))
    assert exc.value.http_status == 400
    with pytest.raises(ServiceError):
        reg.add_model(ModelState(name=""))
    # A proxy cannot serve an external model.
    reg.add_model(ModelState(name="ext", kind=EXTERNAL, base_url="http://u/v1"))
    with pytest.raises(ServiceError) as exc:
        reg.upsert_proxy("p", "127.0.0.1:1", "ext")
    assert exc.value.http_status == 409


def test_proxy_registration_creates_an_implicit_model_that_register_model_takes_over():
    reg = Registry()
    reg.upsert_proxy("p0", "127.0.0.1:1", "m")
    assert reg.models["m"].implicit and reg.models["m"].proxy_ids == ["p0"]
    reg.add_model(ModelState(name="m"))
    assert not reg.models["m"].implicit and reg.models["m"].proxy_ids == ["p0"]
    # An implicit model leaves with its last proxy; a registered one stays.
    reg.upsert_proxy("q0", "127.0.0.1:2", "n")
    reg.remove_proxy("q0")
    assert "n" not in reg.models
    reg.remove_proxy("p0")
    assert reg.models["m"].proxy_ids == []
    for bad in [("", "127.0.0.1:1", "m"), ("p", "nocolon", "m"), ("p", "127.0.0.1:1", "")]:
        with pytest.raises(ServiceError):
            reg.upsert_proxy(*bad)


def test_reregistration_keeps_pins_unless_the_model_changes():
    reg = Registry()
    p, changed = reg.upsert_proxy("p", "127.0.0.1:1", "m")
    assert changed and p.health == UNHEALTHY and p.last_error == NOT_POLLED
    reg.pin(["s"], p)
    reg.record_report(
        "p", healthy=True, draining=False, inflight_requests=2, inflight_tokens=0, sessions=0
    )
    assert p.health == HEALTHY
    # Same address: nothing changes (labels may).
    _, changed = reg.upsert_proxy("p", "127.0.0.1:1", "m", labels={"rank": "0"})
    assert not changed and p.health == HEALTHY and p.labels == {"rank": "0"} and p.load == 2
    # New address (a restarted proxy): health and load start over, pins stay.
    _, changed = reg.upsert_proxy("p", "127.0.0.1:2", "m")
    assert changed and p.health == UNHEALTHY and p.load == 0 and reg.pins == {"s": "p"}
    # Another model: the old pins belonged to the old model.
    q, changed = reg.upsert_proxy("p", "127.0.0.1:2", "other")
    assert changed and q.model == "other" and reg.pins == {}
    assert "m" not in reg.models and reg.models["other"].proxy_ids == ["p"]  # m was implicit


def test_health_transitions():
    reg = Registry()
    p, _ = reg.upsert_proxy("p", "127.0.0.1:1", "m")
    kw = dict(inflight_requests=3, inflight_tokens=40, sessions=2)
    assert reg.record_report("p", healthy=True, draining=False, **kw) == (UNHEALTHY, HEALTHY)
    assert reg.record_failure("p", "refused", unhealthy_after=2) == (HEALTHY, HEALTHY)
    assert reg.record_failure("p", "refused", unhealthy_after=2) == (HEALTHY, UNHEALTHY)
    assert p.last_error == "refused"
    assert reg.record_report("p", healthy=True, draining=False, **kw) == (UNHEALTHY, HEALTHY)
    assert (p.load, p.reported_tokens, p.failures, p.last_error) == (3, 40, 0, "")
    assert p.last_seen_unix_ms > 0
    reg.record_report("p", healthy=True, draining=True, **kw)
    assert p.health == DRAINING
    reg.record_report("p", healthy=False, draining=False, detail="engine down", **kw)
    assert p.health == UNHEALTHY and p.last_error == "engine down"
    reg.record_report("p", healthy=True, draining=False, model="other", **kw)
    assert p.health == UNHEALTHY and "other" in p.last_error
    assert reg.record_report("nope", healthy=True, draining=False, **kw) is None
    assert reg.record_failure("nope", "x", unhealthy_after=1) is None
    info = p.to_proto()
    assert info.health == router_pb2.PROXY_HEALTH_UNHEALTHY and info.inflight_requests == 3


def test_snapshot_round_trip():
    reg = Registry()
    reg.add_model(ModelState(name="m"))
    reg.add_model(ModelState(name="ext", kind=EXTERNAL, base_url="http://u/v1", api_key="sk-1"))
    p, _ = reg.upsert_proxy(
        "p0", "127.0.0.1:1", "m", router_pb2.PROXY_KIND_AGENT, labels={"rank": "0"}
    )
    reg.upsert_proxy("p1", "127.0.0.1:2", "m")
    reg.upsert_proxy("q0", "127.0.0.1:3", "implicit")
    reg.pin(["s1", "s2"], p)
    data = json.loads(json.dumps(reg.to_json()))
    copy = Registry()
    copy.load_json(data)
    assert copy.to_json() == reg.to_json()
    assert copy.proxies["p0"].sessions == {"s1", "s2"}
    assert copy.models["ext"].api_key == "sk-1"
    assert copy.models["implicit"].implicit
    assert copy.models["m"].proxy_ids == ["p0", "p1"]
    with pytest.raises(ValueError):
        copy.load_json({"format": 99})


async def test_state_store_writes_0600_after_changes_and_loads(tmp_path):
    path = tmp_path / "sub" / "router-state.json"
    reg = Registry()
    store = StateStore(path, reg)
    assert not store.load()
    reg.add_model(ModelState(name="m"))
    await asyncio.gather(store.flush(), store.flush())  # on disk when either returns
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert not store.dirty
    reg.upsert_proxy("p", "127.0.0.1:1", "m")
    assert store.dirty
    await store.close()
    again = Registry()
    assert StateStore(path, again).load()
    assert list(again.proxies) == ["p"] and list(again.models) == ["m"]
    assert not any(p.name.startswith(".") for p in path.parent.iterdir())  # no temp files left


def test_state_store_refuses_a_corrupt_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a router state"):
        StateStore(path, Registry()).load()
    path.write_text(json.dumps({"format": 1, "proxies": [{"address": "x"}]}))
    with pytest.raises(ValueError):
        StateStore(path, Registry()).load()


def test_settings_flags_environment_and_defaults(monkeypatch):
    s = parse([])
    assert s == RouterSettings()
    assert (s.host, s.port, s.policy, s.health_interval, s.unhealthy_after) == (
        "127.0.0.1",
        0,
        "round_robin",
        1.0,
        2,
    )
    monkeypatch.setenv("AREAL_ROUTER_POLICY", "least_loaded")
    monkeypatch.setenv("AREAL_ROUTER_HEALTH_INTERVAL", "0.5")
    s = parse(["--unhealthy-after", "3", "--state-file", "st.json"])
    assert (s.policy, s.health_interval, s.unhealthy_after, s.state_file) == (
        "least_loaded",
        0.5,
        3,
        "st.json",
    )
    assert parse(["--policy", "cache_aware"]).policy == "cache_aware"  # flag > env
    with pytest.raises(SystemExit):
        parse(["--policy", "fastest"])
    with pytest.raises(ValueError):
        RouterSettings(unhealthy_after=0)
