"""Routing decisions without a network: policies, health filtering, pins, cache affinity."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from areal_proto.router.v1 import router_pb2
from areal_router.policies import POLICY_NAMES, CacheAware, Router
from areal_router.registry import DRAINING, EXTERNAL, HEALTHY, UNHEALTHY, ModelState, Registry
from areal_runtime.errors import ServiceError


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_registry(clock: Clock | None = None, **models: int) -> Registry:
    """make_registry(a=3, b=2): model a with proxies a0..a2, model b with b0..b1."""
    reg = Registry(monotonic=clock or Clock())
    for name, n in models.items():
        reg.add_model(ModelState(name=name))
        for i in range(n):
            reg.upsert_proxy(f"{name}{i}", f"127.0.0.1:{1000 + i}", name)
            report(reg, f"{name}{i}")  # routable once a poll said so
    return reg


def report(reg: Registry, pid: str, *, requests: int = 0, tokens: int = 0, **kw: bool) -> None:
    reg.record_report(
        pid,
        healthy=kw.get("healthy", True),
        draining=kw.get("draining", False),
        inflight_requests=requests,
        inflight_tokens=tokens,
        sessions=0,
    )


def routes(router: Router, n: int, model: str = "a", **kw) -> Counter[str]:
    out: Counter[str] = Counter()
    for _ in range(n):
        d = router.route(model, **kw)
        assert d.proxy is not None
        out[d.proxy.proxy_id] += 1
    return out


def status_of(exc: pytest.ExceptionInfo[ServiceError]) -> int:
    return exc.value.http_status


# -- every policy ----------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_skips_unhealthy_and_draining_and_uses_them_again(policy):
    reg = make_registry(a=3)
    router = Router(reg, policy, rng=random.Random(1))
    report(reg, "a0", healthy=False)
    report(reg, "a1", draining=True)
    assert reg.proxies["a0"].health == UNHEALTHY
    assert reg.proxies["a1"].health == DRAINING
    got = routes(router, 30, prefix_hashes=[7, 8])
    assert set(got) == {"a2"}
    report(reg, "a0")
    report(reg, "a1")
    report(reg, "a2", requests=50)  # make the others attractive for load-based policies
    got = routes(router, 30)
    assert {"a0", "a1"} <= set(got)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_keeps_models_apart(policy):
    reg = make_registry(a=2, b=2)
    router = Router(reg, policy, rng=random.Random(2))
    report(reg, "b0", requests=100)
    report(reg, "b1", requests=100)
    got_a = routes(router, 40, "a", prefix_hashes=[1, 2, 3])
    got_b = routes(router, 40, "b", prefix_hashes=[1, 2, 3], session_id="")
    assert set(got_a) <= {"a0", "a1"}
    assert set(got_b) <= {"b0", "b1"}


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_no_healthy_proxy_is_unavailable(policy):
    reg = make_registry(a=2)
    router = Router(reg, policy)
    report(reg, "a0", healthy=False)
    report(reg, "a1", draining=True)
    with pytest.raises(ServiceError) as exc:
        router.route("a", session_id="s1")
    assert status_of(exc) == 503
    assert "no healthy proxy" in exc.value.message
    assert exc.value.grpc_status().name == "UNAVAILABLE"


def test_unknown_model_unknown_policy_and_empty_model():
    router = Router(make_registry(a=1))
    with pytest.raises(ServiceError) as exc:
        router.route("nope")
    assert status_of(exc) == 404
    with pytest.raises(ServiceError) as exc:
        router.route("a", policy="fastest")
    assert status_of(exc) == 400
    with pytest.raises(ServiceError) as exc:
        router.route("")
    assert status_of(exc) == 400
    with pytest.raises(ValueError):
        Router(Registry(), "fastest")


def test_model_without_proxies_is_unavailable_and_external_model_has_no_proxy():
    reg = make_registry(a=0)
    router = Router(reg)
    with pytest.raises(ServiceError) as exc:
        router.route("a")
    assert status_of(exc) == 503
    reg.add_model(ModelState(name="ext", kind=EXTERNAL, base_url="http://x/v1", api_key="k"))
    d = router.route("ext")
    assert d.proxy is None and d.model.base_url == "http://x/v1"
    assert d.model.upstream_model == "ext"


def test_kind_filter():
    reg = make_registry(a=2)
    reg.proxies["a1"].kind = router_pb2.PROXY_KIND_AGENT
    router = Router(reg, "round_robin")
    assert set(routes(router, 10, kind=router_pb2.PROXY_KIND_AGENT)) == {"a1"}
    assert set(routes(router, 10, kind=router_pb2.PROXY_KIND_INFERENCE)) == {"a0"}
    assert set(routes(router, 10)) == {"a0", "a1"}


# -- round_robin, least_loaded, power_of_two ------------------------------


@pytest.mark.parametrize("policy", ["least_loaded", "power_of_two", "session_affinity"])
def test_a_burst_spreads_although_reports_lag_it(policy):
    """8 requests routed at once to two replicas, a1 already running one: each poll answered
    meanwhile still says what was in flight before the burst (a0: 0, a1: 1), because the
    requests routed there have not reached the proxy yet. The burst spreads evenly whatever
    the timing of those reports: a route counts as load at once, and a report only replaces
    the routes decided more than `report_grace` before it. (When a report wiped them, a0 looked
    idle after each of its stale reports and drew the whole burst.)"""
    clock = Clock()
    reg = make_registry(clock, a=2)
    router = Router(reg, policy, rng=random.Random(3))
    before = {"a0": 0, "a1": 1}
    report(reg, "a1", requests=1)
    got: Counter[str] = Counter()
    for i in range(8):
        d = router.route("a")
        assert d.proxy is not None
        got[d.proxy.proxy_id] += 1
        clock.now += 0.01
        # The poll of the proxy just chosen comes back from before the request arrived...
        report(reg, d.proxy.proxy_id, requests=before[d.proxy.proxy_id])
        if i % 3 == 0:  # ...and now and then the other one's, as stale.
            other = "a1" if d.proxy.proxy_id == "a0" else "a0"
            report(reg, other, requests=before[other])
    assert got == Counter({"a0": 4, "a1": 4}), got
    assert (reg.proxies["a0"].load, reg.proxies["a1"].load) == (4, 5)
    # Once the requests have had time to arrive, a report is the truth again.
    clock.now += reg.report_grace
    report(reg, "a0", requests=1)
    report(reg, "a1", requests=3)
    assert (reg.proxies["a0"].load, reg.proxies["a1"].load) == (1, 3)
    assert router.route("a").proxy.proxy_id == "a0"  # type: ignore[union-attr]


def test_round_robin_is_even():
    router = Router(make_registry(a=3), "round_robin")
    assert routes(router, 300) == Counter({"a0": 100, "a1": 100, "a2": 100})


def test_least_loaded_follows_reported_load_and_counts_what_it_routed():
    clock = Clock()
    reg = make_registry(clock, a=3)
    router = Router(reg, "least_loaded")
    report(reg, "a0", requests=5)
    report(reg, "a1", requests=1)
    report(reg, "a2", requests=3)
    # a1 takes the first two (1 -> 2 -> 3), then a1/a2 alternate up to 5, then all three.
    got = [router.route("a").proxy.proxy_id for _ in range(6)]  # type: ignore[union-attr]
    assert got[:2] == ["a1", "a1"]
    assert Counter(got) == Counter({"a1": 4, "a2": 2})
    assert reg.proxies["a1"].load == 5 and reg.proxies["a2"].load == 5
    # A new report replaces the estimate, once those routes have had time to reach the proxy.
    clock.now += reg.report_grace + 0.01
    report(reg, "a0", requests=0)
    report(reg, "a1", requests=9)
    report(reg, "a2", requests=9)
    assert router.route("a").proxy.proxy_id == "a0"  # type: ignore[union-attr]
    # Ties on requests are broken by tokens.
    report(reg, "a0", requests=2, tokens=900)
    report(reg, "a1", requests=2, tokens=100)
    report(reg, "a2", requests=2, tokens=500)
    assert router.route("a").proxy.proxy_id == "a1"  # type: ignore[union-attr]


def test_least_loaded_spreads_equal_proxies():
    router = Router(make_registry(a=4), "least_loaded")
    assert routes(router, 40) == Counter({"a0": 10, "a1": 10, "a2": 10, "a3": 10})


def test_power_of_two_never_picks_the_most_loaded_and_spreads():
    reg = make_registry(a=4)
    router = Router(reg, "power_of_two", rng=random.Random(7))
    report(reg, "a3", requests=10_000)
    got = routes(router, 400)
    assert "a3" not in got
    assert all(got[p] > 60 for p in ("a0", "a1", "a2")), got
    # One healthy proxy: always it.
    report(reg, "a0", healthy=False)
    report(reg, "a1", healthy=False)
    report(reg, "a2", healthy=False)
    assert set(routes(router, 5)) == {"a3"}


# -- sessions --------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_bound_group_is_routed_to_its_proxy_under_every_policy(policy):
    reg = make_registry(a=3)
    router = Router(reg, policy, rng=random.Random(3))
    proxy = router.bind(["s1", "s2", "s3"], "a")
    for sid in ("s1", "s2", "s3"):
        got = routes(router, 5, session_id=sid, prefix_hashes=[11])
        assert set(got) == {proxy.proxy_id}
    assert reg.proxies[proxy.proxy_id].sessions == {"s1", "s2", "s3"}


def test_bind_places_groups_by_load():
    reg = make_registry(a=3)
    router = Router(reg)
    report(reg, "a0", requests=4)
    first = router.bind(["g1-0", "g1-1"], "a")
    assert first.proxy_id in {"a1", "a2"}
    second = router.bind(["g2-0", "g2-1"], "a")
    assert {first.proxy_id, second.proxy_id} == {"a1", "a2"}
    # Now a1 and a2 each hold 2 sessions and a0 has 4 in flight: next group to a1/a2 again.
    third = router.bind(["g3-0"], "a")
    assert third.proxy_id in {"a1", "a2"}
    # Explicit proxy.
    assert router.bind(["x"], "a", proxy_id="a0").proxy_id == "a0"
    assert reg.pins["x"] == "a0"


def test_bind_errors():
    reg = make_registry(a=2, b=1)
    router = Router(reg)
    for kwargs, status in [
        ({"session_ids": [], "model_name": "a"}, 400),
        ({"session_ids": ["s"], "model_name": "zz"}, 404),
        ({"session_ids": ["s"], "model_name": "a", "proxy_id": "nope"}, 404),
        ({"session_ids": ["s"], "model_name": "a", "proxy_id": "b0"}, 400),
    ]:
        with pytest.raises(ServiceError) as exc:
            router.bind(**kwargs)
        assert status_of(exc) == status, kwargs
    report(reg, "a0", healthy=False)
    with pytest.raises(ServiceError) as exc:
        router.bind(["s"], "a", proxy_id="a0")
    assert status_of(exc) == 503
    reg.add_model(ModelState(name="ext", kind=EXTERNAL, base_url="http://x"))
    with pytest.raises(ServiceError) as exc:
        router.bind(["s"], "ext")
    assert status_of(exc) == 400
    assert reg.pins == {}


def test_pinned_to_unhealthy_proxy_fails_fast_naming_the_session():
    reg = make_registry(a=2)
    router = Router(reg)
    proxy = router.bind(["sess-42"], "a")
    report(reg, proxy.proxy_id, healthy=False)
    with pytest.raises(ServiceError) as exc:
        router.route("a", session_id="sess-42")
    assert status_of(exc) == 503
    assert "sess-42" in exc.value.message and proxy.proxy_id in exc.value.message
    # Healthy again: the session goes back to its proxy.
    report(reg, proxy.proxy_id)
    assert router.route("a", session_id="sess-42").proxy is proxy


def test_a_pin_is_asked_again_only_when_its_proxy_answered_that_its_engine_is_down():
    reg = make_registry(a=2)
    router = Router(reg)
    proxy = router.bind(["sess-42"], "a")
    pid = proxy.proxy_id
    assert router.pin_to_ask("sess-42") == ""  # healthy: routed as it is
    assert router.pin_to_ask("unknown") == ""
    report(reg, pid, healthy=False)  # it answers; its engine may be back by the next request
    assert router.pin_to_ask("sess-42") == pid
    report(reg, pid, healthy=False, draining=True)  # routed as it is
    assert router.pin_to_ask("sess-42") == ""
    report(reg, pid, healthy=False)
    # Its polls fail (the process is gone): refused at once, no poll timeout to wait.
    reg.record_failure(pid, "connection refused", unhealthy_after=1)
    assert proxy.health == UNHEALTHY and router.pin_to_ask("sess-42") == ""


def test_draining_proxy_keeps_its_pinned_sessions_but_takes_no_new_one():
    """A retired replica (graceful drain) serves its own sessions' turns on other engines;
    new sessions and unpinned requests go to the healthy replicas only."""
    reg = make_registry(a=2)
    router = Router(reg)
    proxy = router.bind(["sess-42"], "a")
    report(reg, proxy.proxy_id, healthy=False, draining=True)
    assert router.route("a", session_id="sess-42").proxy is proxy
    other = next(p for p in reg.proxies.values() if p is not proxy)
    for _ in range(4):
        assert router.route("a").proxy is other
        assert router.route("a", session_id="new-session").proxy is other
    router.bind(["sess-43"], "a")
    assert reg.pins["sess-43"] == other.proxy_id


def test_pinned_session_for_another_model_is_refused():
    reg = make_registry(a=1, b=1)
    router = Router(reg)
    router.bind(["s"], "a")
    with pytest.raises(ServiceError) as exc:
        router.route("b", session_id="s")
    assert status_of(exc) == 400


def test_release_and_deregistration_remove_pins():
    reg = make_registry(a=2, b=1)
    router = Router(reg)
    router.bind(["s1", "s2"], "a", proxy_id="a0")
    router.bind(["s3"], "a", proxy_id="a1")
    router.bind(["t1"], "b")
    assert router.release(["s1", "unknown"]) == 1
    assert set(reg.pins) == {"s2", "s3", "t1"}
    assert reg.remove_proxy("a0")
    assert set(reg.pins) == {"s3", "t1"}
    existed, proxy_ids = reg.remove_model("b")
    assert existed and proxy_ids == ["b0"]
    assert set(reg.pins) == {"s3"}
    assert router.release(["s3"]) == 1
    assert reg.pins == {} and all(not p.sessions for p in reg.proxies.values())


def test_rebinding_moves_the_session():
    reg = make_registry(a=2)
    router = Router(reg)
    router.bind(["s"], "a", proxy_id="a0")
    router.bind(["s"], "a", proxy_id="a1")
    assert reg.pins == {"s": "a1"}
    assert reg.proxies["a0"].sessions == set() and reg.proxies["a1"].sessions == {"s"}


def test_session_affinity_places_new_sessions_by_load_and_pins_them():
    reg = make_registry(a=3)
    router = Router(reg, "session_affinity")
    report(reg, "a0", requests=10)
    placed = {}
    for i in range(4):
        d = router.route("a", session_id=f"s{i}")
        assert d.pinned
        placed[f"s{i}"] = d.proxy.proxy_id  # type: ignore[union-attr]
    assert set(placed.values()) == {"a1", "a2"}
    assert Counter(placed.values()) == Counter({"a1": 2, "a2": 2})
    for sid, pid in placed.items():
        d = router.route("a", session_id=sid)
        assert not d.pinned and d.proxy.proxy_id == pid  # type: ignore[union-attr]
    assert len(reg.pins) == 4
    assert router.release(list(placed)) == 4
    assert reg.pins == {}
    # Without a session: least loaded, nothing pinned.
    d = router.route("a")
    assert not d.pinned and reg.pins == {}


def test_other_policies_do_not_pin_unknown_sessions():
    reg = make_registry(a=2)
    router = Router(reg, "round_robin")
    assert set(routes(router, 4, session_id="s")) == {"a0", "a1"}
    assert reg.pins == {}
    # ...but a per-call override to session_affinity does.
    d = router.route("a", session_id="s", policy="session_affinity")
    assert d.pinned and reg.pins["s"] == d.proxy.proxy_id  # type: ignore[union-attr]


# -- cache_aware -----------------------------------------------------------


def test_cache_aware_sticks_to_the_proxy_that_served_the_prefix():
    reg = make_registry(a=3)
    router = Router(reg, "cache_aware")
    first = router.route("a", prefix_hashes=[101, 102]).proxy
    # Other prompts spread by load...
    others = {router.route("a", prefix_hashes=[200 + i]).proxy.proxy_id for i in range(2)}  # type: ignore[union-attr]
    assert first is not None and first.proxy_id not in others
    # ...while the same prefix (or a longer prompt sharing it) returns to `first`.
    for hashes in ([101, 102], [101, 102, 103], [101]):
        assert router.route("a", prefix_hashes=hashes).proxy is first


def test_cache_aware_prefers_the_longest_known_prefix():
    reg = make_registry(a=2)
    router = Router(reg, "cache_aware")
    p0 = router.route("a", prefix_hashes=[1]).proxy
    assert p0 is not None
    other = next(p for p in reg.proxies.values() if p is not p0)
    cache = router.policies["cache_aware"]
    assert isinstance(cache, CacheAware)
    cache._owner[("a", 3)] = other.proxy_id  # `other` served a longer prompt
    assert router.route("a", prefix_hashes=[1, 2, 3]).proxy is other
    assert router.route("a", prefix_hashes=[1, 2]).proxy is other  # every prefix moved with it


def test_cache_aware_falls_back_when_preferred_is_unhealthy_or_overloaded():
    reg = make_registry(a=2)
    router = Router(reg, "cache_aware")
    home = router.route("a", prefix_hashes=[5]).proxy
    assert home is not None
    away = next(p for p in reg.proxies.values() if p is not home)
    report(reg, home.proxy_id, healthy=False)
    assert router.route("a", prefix_hashes=[5]).proxy is away
    # The prefix now lives on `away`; make `away` overloaded vs. a healthy `home`.
    report(reg, home.proxy_id, requests=0)
    report(reg, away.proxy_id, requests=50)
    assert router.route("a", prefix_hashes=[5]).proxy is home
    # Mildly busier (within the balance thresholds) keeps the affinity.
    report(reg, home.proxy_id, requests=4)
    report(reg, away.proxy_id, requests=0)
    assert router.route("a", prefix_hashes=[5]).proxy is home


def test_cache_aware_ignores_unknown_hashes_and_is_bounded():
    reg = make_registry(a=2)
    router = Router(reg, "cache_aware")
    assert routes(router, 4, prefix_hashes=[0]) == Counter({"a0": 2, "a1": 2})
    cache = CacheAware(capacity=10)
    router.policies["cache_aware"] = cache
    for i in range(1, 100):
        router.route("a", prefix_hashes=[i, i + 1000])
    assert len(cache) == 10
    reg.remove_proxy("a0")
    router.forget_proxies(["a0"])
    assert all(v == "a1" for v in cache._owner.values())


def test_cache_aware_is_per_model():
    reg = make_registry(a=1, b=1)
    router = Router(reg, "cache_aware")
    assert router.route("a", prefix_hashes=[9]).proxy.proxy_id == "a0"  # type: ignore[union-attr]
    assert router.route("b", prefix_hashes=[9]).proxy.proxy_id == "b0"  # type: ignore[union-attr]


def test_a_proxy_is_routable_only_once_a_poll_said_so():
    reg = Registry()
    reg.upsert_proxy("p", "127.0.0.1:1", "m")
    assert reg.proxies["p"].health == UNHEALTHY
    router = Router(reg)
    with pytest.raises(ServiceError) as exc:
        router.route("m")
    assert status_of(exc) == 503
    report(reg, "p")
    assert reg.proxies["p"].health == HEALTHY
    assert router.route("m").proxy.proxy_id == "p"  # type: ignore[union-attr]


def test_cache_aware_keeps_sequential_turns_on_an_idle_owner():
    """Turns of conversations sharing a system prompt, sent one after another (each done
    before the next): the owner of the prefix never has more than one in flight, and every
    poll says so. They all stay there. (Each route used to count as load for `report_grace`
    even after a report that showed it done, so the 9th quick turn saw 8 routes + 1 reported
    on the owner, more than `balance_abs` over the idle other replica, and moved: the e2e
    data path test's conversation split 2 + 1.)"""
    clock = Clock()
    reg = make_registry(clock, a=2)
    router = Router(reg, "cache_aware")
    taken = {"a0": 0, "a1": 0}
    got: Counter[str] = Counter()
    for turn in range(12):
        d = router.route("a", prefix_hashes=[77, 1000 + turn])
        assert d.proxy is not None
        pid = d.proxy.proxy_id
        got[pid] += 1
        # The request arrives and runs (a poll meanwhile sees it), and is done 40 ms later.
        clock.now += 0.02
        taken[pid] += 1
        reg.record_report(
            pid,
            healthy=True,
            draining=False,
            inflight_requests=1,
            inflight_tokens=0,
            sessions=0,
            total_requests=taken[pid],
        )
        clock.now += 0.02
    assert sorted(got.values()) == [12], got
    # What the proxy reports is its load; nothing routed is on its way any more.
    owner = reg.proxies[got.most_common(1)[0][0]]
    assert owner.load == 1 and owner.routed_since_report == 0


def test_a_report_drops_only_the_routes_that_arrived():
    """A route stays counted until a report's count of requests taken covers it: a stale
    report (the same count) leaves the burst on its way counted; one that saw two of three
    arrive leaves the third."""
    clock = Clock()
    reg = make_registry(clock, a=1)
    router = Router(reg, "least_loaded")
    reg.record_report(
        "a0",
        healthy=True,
        draining=False,
        inflight_requests=0,
        inflight_tokens=0,
        sessions=0,
        total_requests=5,
    )
    routes(router, 3)
    p = reg.proxies["a0"]
    for total, inflight, load in ((5, 0, 3), (7, 2, 3), (8, 0, 0)):
        clock.now += 0.01
        reg.record_report(
            "a0",
            healthy=True,
            draining=False,
            inflight_requests=inflight,
            inflight_tokens=0,
            sessions=0,
            total_requests=total,
        )
        assert p.load == load, (total, inflight, p.load)
