"""Admission control: the rule at its edges (pure), and over real gRPC on loopback:
concurrent binds never overshoot, the bounded wait, versions from polls, a restart."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import pytest
from test_server import FAST, Harness, eventually, rpc_error, start_router, stop_router

from areal_proto.router.v1 import router_pb2
from areal_router.admission import Admission
from areal_runtime.errors import AdmissionRefused, InvalidRequest, from_rpc_error

pytestmark = pytest.mark.timeout(60)


def bounds(**kw: int) -> router_pb2.AdmissionSettings:
    return router_pb2.AdmissionSettings(**kw)


def admit(a: Admission, model: str, ids: list[str]) -> AdmissionRefused | None:
    refusal = a.try_admit(model, len(ids))
    if refusal is None:
        a.admitted(model, ids)
    return refusal


# -- the rule, pure ------------------------------------------------------------


def test_no_bounds_admits_everything():
    a = Admission()
    assert admit(a, "m", [f"s{i}" for i in range(1000)]) is None
    assert a.state("m").capacity_left == -1
    assert a.state("m").running == 1000


def test_staleness_bound_at_version_0_then_after_updates_exports_and_acks():
    a = Admission()
    a.configure("m", bounds(max_staleness=0, batch_size=2))
    # (0 + 0 + 1) x 2 = 2 samples at version 0.
    assert admit(a, "m", ["a", "b"]) is None
    refusal = admit(a, "m", ["c"])
    assert refusal is not None and refusal.code == "staleness_bound"
    assert refusal.retry_after_s and refusal.retry_after_s >= 1
    assert "max_staleness" in refusal.message and "version 0" in refusal.message
    # Ending and consuming do not free staleness room: those samples are (to be) trained.
    a.end(["a"])
    assert a.state("m").running == 1 and a.state("m").ended == 1
    assert admit(a, "m", ["c"]) is not None
    a.settle(["a", "b"], consumed=True)
    st = a.state("m")
    assert (st.running, st.ended, st.consumed, st.capacity_left) == (0, 0, 2, 0)
    assert admit(a, "m", ["c"]) is not None
    # Version 1: (0 + 1 + 1) x 2 = 4, minus the 2 consumed.
    a.observe_version("m", 1)
    assert a.state("m").capacity_left == 2
    assert admit(a, "m", ["c", "d"]) is None
    assert admit(a, "m", ["e"]) is not None
    # A dropped session (its start failed, its pin expired) frees its place.
    a.settle(["d"], consumed=False)
    assert admit(a, "m", ["e"]) is None
    # A lagging replica reporting an older version takes nothing back.
    a.observe_version("m", 0)
    assert a.state("m").version == 1
    # The gateway setting a version on every proxy is the truth, lower too (a new run).
    a.set_version("m", 0)
    assert a.state("m").version == 0


def test_concurrency_bound_counts_running_only_and_a_group_counts_n():
    a = Admission()
    a.configure("m", bounds(max_concurrent_rollouts=4))
    assert admit(a, "m", ["a", "b", "c"]) is None
    refusal = admit(a, "m", ["d", "e"])  # 3 + 2 > 4: the whole group is refused
    assert refusal is not None and refusal.code == "capacity_exhausted"
    assert admit(a, "m", ["d"]) is None
    a.end(["a", "b"])  # ended: no longer generating
    assert admit(a, "m", ["e", "f"]) is None
    assert a.state("m").capacity_left == 0 and a.state("m").limited_by == "capacity"
    assert isinstance(a.impossible("m", 5), InvalidRequest)
    assert a.impossible("m", 4) is None


def test_the_tighter_bound_decides_and_settings_are_checked():
    a = Admission()
    a.configure("m", bounds(max_concurrent_rollouts=10, max_staleness=1, batch_size=2))
    st = a.state("m")
    assert (st.capacity_left, st.limited_by) == (4, "staleness")
    with pytest.raises(InvalidRequest) as exc:
        a.configure("m", bounds(max_staleness=2), replace=True)
    assert exc.value.param == "batch_size"
    # The bad change left the bounds as they were.
    assert a.state("m").settings.max_staleness == 1
    a.configure("m", router_pb2.AdmissionSettings(), replace=True)
    assert a.state("m").capacity_left == -1


# -- over gRPC -----------------------------------------------------------------


async def bind(
    h: Harness, ids: list[str], model: str = "m", wait_s: float = 0.0
) -> router_pb2.BindSessionResponse:
    req = router_pb2.BindSessionRequest(session_ids=ids, model=model)
    req.admission.sample_ids.extend(ids)
    req.admission.wait_s = wait_s
    return await h.stub.BindSession(req, timeout=wait_s + 10)


async def state(h: Harness, model: str = "m") -> router_pb2.AdmissionState:
    (st,) = (await h.stub.GetAdmission(router_pb2.GetAdmissionRequest(model=model))).models
    return st


@pytest.fixture
async def router():
    h = await start_router(FAST)
    await h.add_proxy("m-0", "m")
    await h.add_proxy("m-1", "m")
    try:
        yield h
    finally:
        await stop_router(h)


async def test_concurrent_binds_never_overshoot_and_refusals_carry_retry_after(router: Harness):
    await router.stub.SetAdmission(
        router_pb2.SetAdmissionRequest(model="m", settings=bounds(max_concurrent_rollouts=16))
    )
    results = await asyncio.gather(
        *(bind(router, [f"s{i}"]) for i in range(200)), return_exceptions=True
    )
    admitted = [r for r in results if isinstance(r, router_pb2.BindSessionResponse)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(admitted) == 16 and len(refused) == 184
    for exc in refused:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        err = from_rpc_error(exc)
        assert isinstance(err, AdmissionRefused)
        assert err.http_status == 429 and err.code == "capacity_exhausted"
        assert err.retry_after_s == 1
    st = await state(router)
    assert (st.running, st.capacity_left, st.admitted_total, st.refused_total) == (16, 0, 16, 184)
    # Refused starts pinned nothing.
    assert len(router.server.registry.pins) == 16


async def test_a_waiting_start_is_admitted_when_room_appears_or_refused_at_its_deadline(
    router: Harness,
):
    await router.stub.SetAdmission(
        router_pb2.SetAdmissionRequest(model="m", settings=bounds(max_staleness=0, batch_size=1))
    )
    await bind(router, ["a"])
    # Nothing frees room: refused once wait_s has passed, not before.
    t0 = time.monotonic()
    exc = await rpc_error(bind(router, ["b"], wait_s=0.4))
    assert 0.35 <= time.monotonic() - t0 < 3
    assert from_rpc_error(exc).code == "staleness_bound"
    # A weight update gives room: the waiting start goes in at once.
    waiter = asyncio.create_task(bind(router, ["b"], wait_s=20))
    await eventually(lambda: router.server.registry.admission.models["m"].waiting == 1)
    assert (await state(router)).waiting == 1
    await router.stub.SetAdmission(router_pb2.SetAdmissionRequest(model="m", version=1))
    await asyncio.wait_for(waiter, 5)
    st = await state(router)
    assert (st.version, st.running, st.waiting) == (1, 2, 0)


async def test_an_export_ack_consumes_and_a_failed_start_drops(router: Harness):
    await router.stub.SetAdmission(
        router_pb2.SetAdmissionRequest(model="m", settings=bounds(max_concurrent_rollouts=2))
    )
    await bind(router, ["a", "b"])
    await router.stub.EndAdmitted(router_pb2.EndAdmittedRequest(session_ids=["a"]))
    st = await state(router)
    assert (st.running, st.ended) == (1, 1)
    await router.stub.ReleaseSession(
        router_pb2.ReleaseSessionRequest(session_ids=["a"], consumed=True)
    )
    await router.stub.ReleaseSession(router_pb2.ReleaseSessionRequest(session_ids=["b"]))
    st = await state(router)
    assert (st.running, st.ended, st.consumed, st.capacity_left) == (0, 0, 1, 2)
    # A group larger than the concurrency bound can never start: a 400 at once.
    exc = await rpc_error(bind(router, ["x", "y", "z"], wait_s=30))
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(exc).code == "group_too_large"


async def test_the_version_comes_from_the_proxies_polls(router: Harness):
    router.fakes[1].stats["version"] = 3
    await eventually(lambda: router.server.registry.admission.models.get("m") is not None)
    await eventually(lambda: router.server.registry.admission.models["m"].version == 3)


async def test_bounds_version_and_counts_survive_a_router_restart(tmp_path):
    settings = replace(FAST, state_file=str(tmp_path / "router.db"))
    h = await start_router(settings)
    fakes = []
    try:
        await h.add_proxy("m-0", "m")
        await h.stub.SetAdmission(
            router_pb2.SetAdmissionRequest(
                model="m",
                settings=bounds(max_staleness=1, batch_size=4, max_concurrent_rollouts=3),
                version=2,
            )
        )
        for sid in ("a", "b", "c"):
            await bind(h, [sid])
        await h.stub.EndAdmitted(router_pb2.EndAdmittedRequest(session_ids=["a", "b"]))
        await h.stub.ReleaseSession(
            router_pb2.ReleaseSessionRequest(session_ids=["a"], consumed=True)
        )
        before = await state(h)
    finally:
        fakes = h.fakes
        await stop_router(h)
    await fakes[0].start(fakes[0].port)
    h = await start_router(settings)
    h.fakes = fakes
    try:
        after = await state(h)
        keep = ("settings", "version", "running", "ended", "consumed", "capacity_left")
        assert [getattr(after, k) for k in keep] == [getattr(before, k) for k in keep]
        assert (after.running, after.ended, after.consumed, after.version) == (1, 1, 1, 2)
        # (1 + 2 + 1) x 4 = 16 - 3 used = 13 by staleness; 3 - 1 running = 2 by capacity.
        assert (after.capacity_left, after.limited_by) == (2, "capacity")
    finally:
        await stop_router(h)


async def test_settings_errors_name_the_field(router: Harness):
    exc = await rpc_error(
        router.stub.SetAdmission(
            router_pb2.SetAdmissionRequest(model="m", settings=bounds(batch_size=4))
        )
    )
    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(exc).param == "max_staleness"
    exc = await rpc_error(
        router.stub.SetAdmission(router_pb2.SetAdmissionRequest(model="nope", settings=bounds()))
    )
    assert exc.code() == grpc.StatusCode.NOT_FOUND


async def test_the_staleness_bound_holds_while_versions_rise_under_concurrent_starts(
    router: Harness,
):
    await router.stub.SetAdmission(
        router_pb2.SetAdmissionRequest(model="m", settings=bounds(max_staleness=0, batch_size=8))
    )
    adm = router.server.registry.admission
    worst: list[int] = []

    async def watch() -> None:
        # The invariant at every moment the event loop lets us look.
        while True:
            st = adm.state("m")
            worst.append(st.running + st.ended + st.consumed - (st.version + 1) * 8)
            await asyncio.sleep(0)

    async def updates() -> None:
        for v in (1, 2, 3):
            await asyncio.sleep(0.1)
            await router.stub.SetAdmission(router_pb2.SetAdmissionRequest(model="m", version=v))

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(
        updates(),
        *(bind(router, [f"s{i}"], wait_s=1.0) for i in range(100)),
        return_exceptions=True,
    )
    watcher.cancel()
    admitted = [r for r in results[1:] if isinstance(r, router_pb2.BindSessionResponse)]
    # (0 + 3 + 1) x 8: exactly the room the three updates made, never more.
    assert len(admitted) == 32
    assert max(worst) <= 0
    st = await state(router)
    assert (st.version, st.running, st.capacity_left) == (3, 32, 0)
