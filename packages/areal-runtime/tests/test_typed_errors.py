"""The typed errors: the tree the module docstring draws, their HTTP and gRPC mapping, and the
class surviving a real gRPC hop."""

from __future__ import annotations

import re

import grpc
import pytest

from areal_proto.common.v1 import envelope_pb2
from areal_proto.router.v1 import router_pb2, router_pb2_grpc
from areal_runtime import errors
from areal_runtime.errors import ERROR_CLASSES, ServiceError

# One line of the docstring's tree: "├── Name   503  type  code".
_TREE_LINE = re.compile(
    r"^(?P<lead>[ │├└─]*)(?P<name>[A-Z]\w+)\s+(?P<status>\d{3}|any)\b(?P<rest>.*)$"
)


def _tree() -> list[tuple[int, str, list[str]]]:
    """(depth, class name, [status, type, code]) for each class line of the docstring."""
    out = []
    for line in (errors.__doc__ or "").splitlines():
        m = _TREE_LINE.match(line.strip("\n")[4:] if line.startswith("    ") else line)
        if m:
            depth = len(m["lead"]) // 4
            out.append((depth, m["name"], [m["status"], *m["rest"].split()[:2]]))
    return out


def test_docstring_draws_exactly_the_hierarchy():
    tree = _tree()
    assert tree[0][:2] == (0, "ServiceError")
    assert [name for _, name, _ in tree[1:]] == [c.__name__ for c in ERROR_CLASSES]
    parents: list[str] = []
    for depth, name, (status, typ, code) in tree:
        del parents[depth:]
        cls = getattr(errors, name)
        if parents:
            assert cls.__mro__[1].__name__ == parents[-1] or (
                parents[-1] == "ServiceError" and cls.__mro__[1] is errors._Typed
            ), name
            assert (int(status), typ, code) == (cls.http_status, cls.type, cls.code or "-"), name
        parents.append(name)


def test_every_class_has_a_distinct_status_type_code():
    seen = {(c.http_status, c.type, c.code) for c in ERROR_CLASSES}
    assert len(seen) == len(ERROR_CLASSES)
    owned = [code for c in ERROR_CLASSES for code in c.codes]
    assert len(owned) == len(set(owned)), "a code may stand for one class only"
    for cls in ERROR_CLASSES:
        assert not cls.codes or cls.codes[0] == cls.code, cls


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_http_body_and_grpc_status(cls):
    err = cls("it broke", param="p")
    assert isinstance(err, ServiceError) and str(err) == "it broke"
    assert err.to_openai() == {
        "error": {"message": "it broke", "type": cls.type, "code": cls.code, "param": "p"}
    }
    expected = errors._TO_GRPC.get(cls.http_status, grpc.StatusCode.INTERNAL)
    assert err.grpc_status() == expected


def test_grpc_status_by_meaning():
    assert errors.Draining("x").grpc_status() == grpc.StatusCode.UNAVAILABLE
    assert errors.SessionNotFound("x").grpc_status() == grpc.StatusCode.NOT_FOUND
    assert errors.SessionExists("x").grpc_status() == grpc.StatusCode.FAILED_PRECONDITION
    assert errors.PayloadTooLarge("x").grpc_status() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors.Cancelled("x").grpc_status() == grpc.StatusCode.CANCELLED
    assert errors.UpstreamTimeout("x").grpc_status() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert errors.UpstreamError("x").grpc_status() == grpc.StatusCode.INTERNAL


def test_codes_override_and_leaves_refuse_foreign_codes():
    err = errors.NotFound("group 'g' not found", code="group_not_found")
    assert (err.http_status, err.type, err.code) == (404, "not_found_error", "group_not_found")
    assert errors.NoHealthyReplica("x", code="no_healthy_proxy").code == "no_healthy_proxy"
    with pytest.raises(ValueError, match="Draining takes code draining"):
        errors.Draining("x", code="shutting_down")


def _all_variants() -> list[ServiceError]:
    out: list[ServiceError] = []
    for cls in ERROR_CLASSES:
        out.append(cls("m", param="p"))
        out += [cls("m", code=c) for c in cls.codes[1:]]
    # A status class under a precise code, and a status no class names.
    out.append(errors.Conflict("m", code="session_ended"))
    out.append(ServiceError(405, "m", code="method_not_allowed"))
    return out


@pytest.mark.parametrize("err", _all_variants(), ids=repr)
def test_detail_round_trip_rebuilds_the_class(err):
    wire = envelope_pb2.ErrorDetail.FromString(err.detail().SerializeToString())
    back = ServiceError.from_detail(wire)
    assert type(back) is type(err)
    assert back.http_status == err.http_status and back.to_openai() == err.to_openai()


def test_rebuilding_keeps_the_wire_as_it_was():
    # A status class sent without a code comes back without one, not with a class default.
    back = errors.error_for(500, "engine failed", type="api_error", code="engine_error")
    assert type(back) is errors.InternalError and back.code == "engine_error"
    back = errors.error_for(503, "engine down", type="api_error", code="engine_unavailable")
    assert isinstance(back, errors.Unavailable) and back.type == "api_error"
    back = errors.error_for(499, "gone")
    assert type(back) is errors.Cancelled and back.code is None
    # A known code under another status is not that class.
    assert type(errors.error_for(500, "x", code="draining")) is errors.InternalError
    # A precise code a status class carries finds the leaf that owns it.
    assert type(errors.error_for(404, "x", code="session_not_found")) is errors.SessionNotFound


class _Raising(router_pb2_grpc.RouterServiceServicer):
    """`Route(model=<class name>)` fails with that class; `model="raw:<STATUS>"` with a bare
    status, as a server without our detail (or grpc itself) would."""

    async def Route(self, request, context):
        if request.model.startswith("raw:"):
            status = grpc.StatusCode[request.model.removeprefix("raw:")]
            await context.abort(status, "bare status")
        code = request.session_id or None
        await errors.abort(context, getattr(errors, request.model)("failed there", code=code))


@pytest.fixture
async def stub():
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(_Raising(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield router_pb2_grpc.RouterServiceStub(ch)
    await server.stop(None)


async def _call(stub, model: str, code: str = "") -> ServiceError:
    try:
        await stub.Route(router_pb2.RouteRequest(model=model, session_id=code))
    except grpc.aio.AioRpcError as exc:
        return errors.from_rpc_error(exc, target="router")
    raise AssertionError("the call succeeded")


async def test_every_class_survives_a_real_grpc_hop(stub):
    for cls in ERROR_CLASSES:
        err = await _call(stub, cls.__name__)
        assert type(err) is cls, (cls, err)
        assert err.to_openai() == cls("failed there").to_openai()
    err = await _call(stub, "NoHealthyReplica", "no_healthy_pair")
    assert type(err) is errors.NoHealthyReplica and err.code == "no_healthy_pair"


async def test_except_clauses_work_across_the_hop(stub):
    with pytest.raises(errors.Draining):
        raise await _call(stub, "Draining")
    try:
        raise await _call(stub, "SessionNotFound")
    except errors.Unavailable:
        pytest.fail("a missing session is not unavailable")
    except errors.NotFound as e:
        assert e.code == "session_not_found"


@pytest.mark.parametrize(
    ("status", "cls", "status_code", "code"),
    [
        ("UNAVAILABLE", errors.UpstreamUnavailable, 503, "upstream_unavailable"),
        ("DEADLINE_EXCEEDED", errors.UpstreamTimeout, 504, "upstream_timeout"),
        ("INTERNAL", errors.UpstreamError, 502, "upstream_error"),
        ("NOT_FOUND", errors.NotFound, 404, None),
        ("ALREADY_EXISTS", errors.Conflict, 409, None),
        ("RESOURCE_EXHAUSTED", errors.Overloaded, 429, None),
        # Bare: the callee's token interceptor, i.e. the internal token (never a client 401).
        ("UNAUTHENTICATED", errors.InternalAuthFailed, 502, "internal_auth_failed"),
    ],
)
async def test_a_bare_status_maps_by_status(stub, status, cls, status_code, code):
    err = await _call(stub, f"raw:{status}")
    assert type(err) is cls and (err.http_status, err.code) == (status_code, code)
    if cls is errors.UpstreamUnavailable:
        assert err.message == "router unavailable: bare status"


def test_retry_after_travels_in_the_detail():
    err = errors.AdmissionRefused("full", code="staleness_bound", retry_after_s=7)
    back = ServiceError.from_detail(
        envelope_pb2.ErrorDetail.FromString(err.detail().SerializeToString())
    )
    assert isinstance(back, errors.AdmissionRefused) and back.code == "staleness_bound"
    assert back.retry_after_s == 7 and back.http_status == 429
    # An error that says nothing keeps saying nothing.
    plain = ServiceError.from_detail(errors.Overloaded("busy").detail())
    assert plain.retry_after_s is None
