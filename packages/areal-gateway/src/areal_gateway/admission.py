"""Admission control's admin API (docs/services.md, "Admission"); the admin key.

| GET /admin/admission                | every internal model's bounds, version and counts |
| GET /admin/models/{name}/admission  | one model's                                       |
| PUT /admin/models/{name}/admission  | change its bounds (a field given sets, null unsets) |

The router holds the bounds and the counts (areal_router.admission), so every gateway of the
service sees and enforces the same ones; this module only validates and shapes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import Response

from areal_gateway.api import ERRORS, AdminKey, GatewayDep, GatewayRoute, json_response
from areal_gateway.schemas import AdmissionList, AdmissionStatus, AdmissionUpdate
from areal_proto.router.v1 import router_pb2
from areal_runtime.errors import UnknownModel

_BOUNDS = ("max_staleness", "batch_size", "max_concurrent_rollouts")


def admission_json(st: router_pb2.AdmissionState) -> dict[str, Any]:
    out: dict[str, Any] = {"model": st.model}
    for name in _BOUNDS:
        out[name] = getattr(st.settings, name) if st.settings.HasField(name) else None  # type: ignore[arg-type]
    out.update(
        version=st.version,
        running=st.running,
        ended=st.ended,
        consumed=st.consumed,
        capacity_left=None if st.capacity_left < 0 else st.capacity_left,
        limited_by=st.limited_by or None,
        admitted_total=st.admitted_total,
        refused_total=st.refused_total,
        waiting=st.waiting,
    )
    return out


router = APIRouter(route_class=GatewayRoute, responses=ERRORS, tags=["admin"])


@router.get("/admin/admission", response_model=AdmissionList)
async def list_admission(gw: GatewayDep, _: AdminKey) -> Response:
    """Every internal model's admission bounds, weight version and counts."""
    states = await gw.router.get_admission()
    return json_response({"models": [admission_json(s) for s in states]})


async def _known(gw: GatewayDep, name: str) -> None:
    models = await gw.router.list_models()
    if not any(m.name == name and m.kind != router_pb2.MODEL_KIND_EXTERNAL for m in models):
        raise UnknownModel(f"Model {name!r} is not an internal model served here.", param="name")


@router.get("/admin/models/{name}/admission", response_model=AdmissionStatus)
async def get_admission(name: str, gw: GatewayDep, _: AdminKey) -> Response:
    """One model's admission bounds, weight version and counts."""
    await _known(gw, name)
    (state,) = await gw.router.get_admission(name)
    return json_response(admission_json(state))


@router.put("/admin/models/{name}/admission", response_model=AdmissionStatus)
async def put_admission(name: str, body: AdmissionUpdate, gw: GatewayDep, _: AdminKey) -> Response:
    """Change a model's bounds at run time: a field given sets that bound, `null` removes
    it, a field left out keeps it. Starts waiting for room re-check at once."""
    await _known(gw, name)
    (current,) = await gw.router.get_admission(name)
    settings = router_pb2.AdmissionSettings()
    given = body.model_fields_set
    for field in _BOUNDS:
        value = getattr(body, field) if field in given else None
        if field not in given and current.settings.HasField(field):  # type: ignore[arg-type]
            value = getattr(current.settings, field)
        if value is not None:
            setattr(settings, field, value)
    state = await gw.router.set_admission(
        name, settings, replace=True, reset_consumed=body.reset_consumed
    )
    return json_response(admission_json(state))
