"""One RL row schema: proto/rl_row.schema.json, and the three declarations held to it.

- the proxy's export (areal_proxy.recording.export): rows it really builds are valid
  (packages/areal-proxy/tests/test_export_schema.py does the same over gRPC for a chat turn,
  a completion and n choices, with and without rewards);
- the gateway's OpenAPI (areal_gateway.schemas.TrajectoryRow, as the app documents it): the
  same fields, types, required-ness and descriptions, no others;
- the client's type (areal_client.types.Trajectory): the same fields and types, and a valid
  row parses and gives itself back.

No engine, no network.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi import FastAPI
from testpaths import ROOT

from areal_client.spans import prompt_hash, uncertified_spans
from areal_client.types import ExportResult, Trajectory
from areal_gateway.app import api_routers
from areal_gateway.schemas import TrajectoryRow
from areal_proxy.common.records import Interaction, Session
from areal_proxy.recording import export

SCHEMA_PATH: Path = ROOT / "proto" / "rl_row.schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


Shape = tuple[str, "Shape | tuple[Shape, ...] | None"]


def _shape(prop: dict[str, Any]) -> Shape:
    """(type, shape of the items) of one property's schema: a list's item shape, or the
    shapes of a fixed-length tuple's items (prefixItems, exactly that many), or an object's
    (name, shape) pairs, by name."""
    if prop["type"] == "object":
        props = prop["properties"]
        return "object", tuple((name, _shape(props[name])) for name in sorted(props))
    if "prefixItems" in prop:
        n = len(prop["prefixItems"])
        assert (prop.get("minItems"), prop.get("maxItems"), prop.get("items")) == (n, n, None)
        return prop["type"], tuple(_shape(p) for p in prop["prefixItems"])
    items = prop.get("items")
    return prop["type"], _shape(items) if items is not None else None


CANONICAL = {name: _shape(p) for name, p in SCHEMA["properties"].items()}
REQUIRED = set(SCHEMA["required"])


# --- the schema itself -----------------------------------------------------------------------


def test_the_schema_is_a_closed_json_schema_with_every_field_described() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["type"] == "object" and SCHEMA["additionalProperties"] is False
    assert REQUIRED <= set(SCHEMA["properties"])
    for name, prop in SCHEMA["properties"].items():
        assert prop["description"] and "\n" not in prop["description"], name
        assert (prop["type"] == "array") == ("items" in prop), name
        if prop["type"] != "object":
            assert set(prop) <= {"type", "items", "description"}, name
            continue
        # An object field is closed, every one of its fields required.
        assert set(prop) == {
            "type",
            "description",
            "properties",
            "required",
            "additionalProperties",
        }, name
        assert prop["additionalProperties"] is False, name
        assert sorted(prop["required"]) == sorted(prop["properties"]), name
    # The optional field is the agent mode's one; everything else is always there.
    assert set(SCHEMA["properties"]) - REQUIRED == {"agent_session_id"}


# --- the proxy: rows its export code builds ------------------------------------------------------


def _turn(iid: str, prompt: list[int], out: list[int], **kw: Any) -> Interaction:
    kw.setdefault("prompt_hash", prompt_hash(prompt))
    return Interaction(
        interaction_id=iid,
        session_id="sess-1",
        seq=0,
        messages=[{"role": "user", "content": "q"}],
        response={"role": "assistant", "content": "a"},
        prompt_ids=prompt,
        output_ids=out,
        logprobs=[-0.5] * len(out),
        versions=[3] * len(out),
        finish_reason=kw.pop("finish_reason", "stop"),
        **kw,
    )


def proxy_rows(style: str) -> list[dict[str, Any]]:
    session = Session("sess-1", "group-1", "task-1", "hash", "m", 0.0, 0.0)
    turns = [
        _turn("chatcmpl-a", [1, 2], [3, 4], reward=1.0, tools_declared=2, tool_calls_made=1),
        # continues the first turn's exact tokens (a concat row spans both)
        _turn("chatcmpl-b", [1, 2, 3, 4, 5], [6], parent_id="chatcmpl-a", inherited=4),
        # two choices of one request; one rewarded, one not
        _turn("chatcmpl-c-0", [1], [7], response_id="chatcmpl-c", reward=0.5),
        _turn("chatcmpl-c-1", [1], [8], response_id="chatcmpl-c", choice_index=1),
        # a side call, as its request's x-areal-call header said
        _turn("chatcmpl-f", [1], [14], call_kind="side"),
        _turn("cmpl-d", [9], [10, 11], finish_reason="length"),
        # migrated mid-generation: p1's engine made one token, p2's the other
        _turn("chatcmpl-e", [9], [12, 13], replicas=[(0, "p1"), (1, "p2")]),
    ]
    return list(export.rows([(session, turns)], style, 0.9, "p1"))


ROWS = [*proxy_rows("individual"), *proxy_rows("concat")]
# An agent proxy passes the inference rows on with the agent session's id
# (areal_proxy/agent/service.py, ExportAgentTrajectories).
AGENT_ROWS = [{**row, "agent_session_id": "agent-1"} for row in proxy_rows("individual")]


@pytest.mark.parametrize("row", ROWS + AGENT_ROWS, ids=lambda r: r["interaction_id"])
def test_proxy_rows_are_valid(row: dict[str, Any]) -> None:
    assert [e.message for e in VALIDATOR.iter_errors(row)] == []


def test_proxy_rows_cover_the_schema_and_invalid_rows_are_refused() -> None:
    assert {k for r in ROWS for k in r} == REQUIRED
    assert {r["choice_index"] for r in ROWS} == {0, 1} and len(ROWS) == 7 + 6
    assert {len(r["replicas"]) for r in ROWS} == {1, 2}
    assert {len(r["spans"]) for r in ROWS} == {1, 2} and {r["side"] for r in ROWS} == {True, False}
    assert {r["parent_chain"] for r in ROWS} >= {"", "chatcmpl-a"}
    # Every span is certified: the client's hash of its prefix is the one it carries.
    for r in ROWS:
        assert uncertified_spans(r["input_ids"], r["spans"]) == [], r["interaction_id"]
    row = ROWS[0]
    for bad in (
        {**row, "surprise": 1},
        {k: v for k, v in row.items() if k != "response_id"},
        {**row, "choice_index": "0"},
        {**row, "logprobs": ["x"]},
        {**row, "agent_session_id": None},
        {**row, "replicas": [[2, "p1", 3]]},
        {**row, "replicas": [[2]]},
        {**row, "replicas": [["2", "p1"]]},
        {**row, "replicas": [[2, None]]},
        {**row, "replicas": [2, "p1"]},
        {**row, "side": 0},
        {**row, "parent_chain": None},
        {**row, "spans": [[2, 4]]},
        {**row, "spans": [[2, 4, None]]},
        {**row, "tool_calls": {"declared": 1, "called": 0}},
        {**row, "tool_calls": {"declared": 1, "called": 0, "parsed": 0, "made": 0}},
        {**row, "tool_calls": [1, 0, 0]},
    ):
        assert not VALIDATOR.is_valid(bad), bad


# --- the gateway: its OpenAPI model --------------------------------------------------------------


def _documented(doc: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pydantic / OpenAPI object schema reduced to what the canonical schema says; a
    field that refers to another schema (`$ref`, found in `defs`) is read as that schema."""
    props = {}
    for name, p in doc["properties"].items():
        if "$ref" in p:
            assert defs is not None, name
            target = defs[p["$ref"].rsplit("/", 1)[1]]
            # Closed, every field required, as the canonical schema's object fields are.
            assert target["additionalProperties"] is False, name
            assert sorted(target["required"]) == sorted(target["properties"]), name
            p = {**target, "description": p.get("description")}
        props[name] = p
    return {
        "fields": {name: _shape(p) for name, p in props.items()},
        "descriptions": {name: p.get("description") for name, p in props.items()},
        "required": set(doc.get("required", [])),
        "additionalProperties": doc.get("additionalProperties"),
    }


CANONICAL_DOC = _documented(SCHEMA)


def test_gateway_model_is_the_canonical_schema() -> None:
    schema = TrajectoryRow.model_json_schema()
    assert _documented(schema, schema.get("$defs")) == CANONICAL_DOC


@pytest.mark.parametrize("mode", ["inference", "agent"])
def test_gateway_openapi_documents_the_canonical_row(mode: str) -> None:
    app = FastAPI()
    for router in api_routers(mode):
        app.include_router(router)
    components = app.openapi()["components"]["schemas"]
    assert _documented(components["TrajectoryRow"], components) == CANONICAL_DOC
    result = "ExportResult" if mode == "inference" else "AgentExportResult"
    rows = components[result]["properties"]["rows"]
    assert rows["items"] == {"$ref": "#/components/schemas/TrajectoryRow"}


def test_gateway_model_accepts_exactly_the_valid_rows() -> None:
    for row in ROWS + AGENT_ROWS:
        dumped = TrajectoryRow.model_validate(row).model_dump(mode="json", exclude_none=True)
        assert dumped == row
    with pytest.raises(ValueError, match="surprise"):
        TrajectoryRow.model_validate({**ROWS[0], "surprise": 1})


# --- the client: its dataclass -------------------------------------------------------------------

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _json_shape(hint: Any) -> tuple[Shape, bool]:
    """(type, shape of the items) of a type hint, and whether it admits None."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and type(None) in args:
        [inner] = [a for a in args if a is not type(None)]
        return _json_shape(inner)[0], True
    if typing.get_origin(hint) is list:
        return ("array", _json_shape(args[0])[0]), False
    if typing.get_origin(hint) is tuple:
        assert ... not in args, hint
        return ("array", tuple(_json_shape(a)[0] for a in args)), False
    if dataclasses.is_dataclass(hint):
        inner = typing.get_type_hints(hint)
        names = sorted(f.name for f in dataclasses.fields(hint))
        return ("object", tuple((n, _json_shape(inner[n])[0]) for n in names)), False
    return (_JSON_TYPES[hint], None), False


def _as_json(value: Any) -> Any:
    """A parsed field as JSON has it (a tuple is an array, a dataclass an object)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_as_json(v) for v in value]
    return value


def test_client_type_has_the_canonical_fields_and_types() -> None:
    hints = typing.get_type_hints(Trajectory)
    fields = {f.name: f for f in dataclasses.fields(Trajectory) if f.name != "extra"}
    assert set(fields) == set(CANONICAL)
    for name, f in fields.items():
        shape, optional = _json_shape(hints[name])
        assert shape == CANONICAL[name], name
        # Required: no default and no None; optional: absent is None.
        assert optional == (name not in REQUIRED), name
        assert (f.default is dataclasses.MISSING) == (name in REQUIRED), name


@pytest.mark.parametrize("row", ROWS + AGENT_ROWS, ids=lambda r: r["interaction_id"])
def test_client_parses_a_valid_row_and_gives_it_back(row: dict[str, Any]) -> None:
    parsed = Trajectory.from_json(row)
    assert parsed.extra == {}
    assert {k: _as_json(getattr(parsed, k)) for k in row} == row
    assert parsed.to_dict() == row
    assert [e.message for e in VALIDATOR.iter_errors(parsed.to_dict())] == []


def test_client_parses_a_whole_export() -> None:
    result = ExportResult.from_json({"count": len(ROWS), "rows": ROWS})
    assert [r.to_dict() for r in result] == ROWS
