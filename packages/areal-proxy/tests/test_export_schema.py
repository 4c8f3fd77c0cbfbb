"""Rows the proxy really exports (the real ProxyServer over gRPC, a fake engine) are valid
against the canonical row schema, proto/rl_row.schema.json.

The proxy's environment has no JSON Schema library, so a small strict checker for the subset
that schema uses is here; it refuses any keyword it does not implement, so the schema cannot
grow a rule this test silently skips.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from proxy_fakes import EOS, FakeEngineClient, start
from test_proxy_sessions import _export, _group, _key_env

from areal_client.spans import prompt_hash, uncertified_spans
from areal_proto.proxy.v1 import proxy_pb2

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "proto" / "rl_row.schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())

_KNOWN = {
    "$schema",
    "title",
    "description",
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
}
_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    # bool is an int in Python, not in JSON; 1.0 is refused as an integer (stricter than
    # the spec, which the proxy's rows never need).
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def schema_errors(schema: dict[str, Any], value: Any, at: str = "$") -> list[str]:
    """Every way `value` breaks `schema` (empty: valid)."""
    unknown = set(schema) - _KNOWN
    if unknown:
        raise ValueError(f"{at}: the checker does not implement {sorted(unknown)}")
    kind = schema.get("type")
    if kind is not None and not _TYPES[kind](value):
        return [f"{at}: {value!r:.60} is not of type {kind}"]
    errors: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{at}: missing required {name!r}")
        for name, item in value.items():
            if name in props:
                errors += schema_errors(props[name], item, f"{at}.{name}")
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{at}: unexpected {name!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{at}: {value!r:.60} is too short")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{at}: {value!r:.60} is too long")
        # prefixItems: one schema per leading item; items: the rest.
        prefix = schema.get("prefixItems", [])
        for i, (sub, item) in enumerate(zip(prefix, value, strict=False)):
            errors += schema_errors(sub, item, f"{at}[{i}]")
        if "items" in schema:
            for i, item in enumerate(value[len(prefix) :], start=len(prefix)):
                errors += schema_errors(schema["items"], item, f"{at}[{i}]")
    return errors


def _valid_row(**over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "logprobs": [0.0, -0.5, -0.25],
        "versions": [-1, 0, 0],
        "reward": 1.0,
        "session_id": "s",
        "group_id": "g",
        "task_id": "t",
        "interaction_id": "i",
        "interaction_ids": ["i"],
        "response_id": "i",
        "choice_index": 0,
        "replicas": [[1, "p0"]],
        "finish_reason": "stop",
        "chain_id": "i",
        "chain_reason": "root",
        "parent_chain": "",
        "side": False,
        "spans": [[1, 3, "00" * 16]],
        "tool_calls": {"declared": 0, "called": 0, "parsed": 0},
        "min_version": 0,
        "max_version": 0,
        "staleness": 0,
        "stale": False,
        "failure": "",
    }
    row.update(over)
    return row


@pytest.mark.parametrize(
    ("row", "error"),
    [
        (_valid_row(surprise=1), "unexpected 'surprise'"),
        ({k: v for k, v in _valid_row().items() if k != "choice_index"}, "missing required"),
        (_valid_row(choice_index=True), "$.choice_index: True is not of type integer"),
        (_valid_row(versions=[-1, 0.5, 0]), "$.versions[1]: 0.5 is not of type integer"),
        (_valid_row(reward=None), "$.reward: None is not of type number"),
        (_valid_row(finish_reason=None), "is not of type string"),
        ({k: v for k, v in _valid_row().items() if k != "replicas"}, "missing required"),
        (_valid_row(replicas=[[1, "p0", 2]]), "$.replicas[0]: [1, 'p0', 2] is too long"),
        (_valid_row(replicas=[[1]]), "$.replicas[0]: [1] is too short"),
        (_valid_row(replicas=[["1", "p0"]]), "$.replicas[0][0]: '1' is not of type integer"),
        (_valid_row(replicas=[[1, 0]]), "$.replicas[0][1]: 0 is not of type string"),
        (_valid_row(replicas=[2]), "$.replicas[0]: 2 is not of type array"),
        (_valid_row(agent_session_id=7), "$.agent_session_id: 7 is not of type string"),
        (_valid_row(side=0), "$.side: 0 is not of type boolean"),
        (_valid_row(parent_chain=None), "$.parent_chain: None is not of type string"),
        (_valid_row(spans=[[1, 3]]), "$.spans[0]: [1, 3] is too short"),
        (_valid_row(spans=[[1, "3", "h"]]), "$.spans[0][1]: '3' is not of type integer"),
        (_valid_row(tool_calls={"declared": 1, "called": 0}), "missing required 'parsed'"),
        (
            _valid_row(tool_calls={"declared": 1, "called": 0, "parsed": 0, "x": 1}),
            "$.tool_calls: unexpected 'x'",
        ),
        (
            _valid_row(tool_calls={"declared": 1, "called": 0, "parsed": True}),
            "$.tool_calls.parsed: True is not of type integer",
        ),
    ],
)
def test_the_checker_refuses_what_the_schema_refuses(row: dict[str, Any], error: str) -> None:
    assert schema_errors(SCHEMA, _valid_row()) == []
    assert schema_errors(SCHEMA, _valid_row(agent_session_id="a")) == []
    errors = schema_errors(SCHEMA, row)
    assert len(errors) == 1 and error in errors[0], errors


def test_the_checker_refuses_a_keyword_it_does_not_implement() -> None:
    with pytest.raises(ValueError, match="minimum"):
        schema_errors({"type": "integer", "minimum": 0}, 1)


async def test_every_exported_row_matches_the_canonical_schema() -> None:
    h = await start(FakeEngineClient([7, 8, EOS]))
    try:
        [(sid, key)] = await _group(h)
        msgs = [{"role": "user", "content": "hi"}]
        chat = await h.chat({"messages": msgs, "max_tokens": 10}, api_key=key, session_id=sid)
        text = await h.completion({"prompt": "once", "max_tokens": 10}, api_key=key, session_id=sid)
        many = await h.chat({"messages": msgs, "n": 3}, api_key=key, session_id=sid)
        # Rewards last: the first one closes the session for turns.
        for iid, reward in ((f"{many['id']}-1", -1.0), (chat["id"], 1.5)):
            await h.stub.SetReward(
                proxy_pb2.SetRewardRequest(
                    session_id=sid, interaction_id=iid, reward=reward, envelope=_key_env(sid, key)
                )
            )
        exports = {
            (style, discount): await _export(h, session_ids=[sid], style=style, discount=discount)
            for style in ("individual", "concat", "")
            for discount in (0.0, 0.5)
        }
        # No style: one row per chain.
        assert exports[("", 0.5)] == exports[("concat", 0.5)]
        for where, rows in exports.items():
            assert rows, where
            for row in rows:
                assert schema_errors(SCHEMA, row) == [], (where, row)
                # Inference mode: every required field, nothing else.
                assert set(row) == set(SCHEMA["required"]), where
        # What the rows cover: a chat turn, a completion, the choices of an n > 1 request,
        # rewarded and unrewarded rows.
        rows = {r["interaction_id"]: r for r in exports[("individual", 0.0)]}
        assert set(rows) == {chat["id"], text["id"], *(f"{many['id']}-{i}" for i in range(3))}
        assert rows[chat["id"]]["reward"] == 1.5 and rows[text["id"]]["reward"] == 0.0
        assert [rows[f"{many['id']}-{i}"]["choice_index"] for i in range(3)] == [0, 1, 2]
        assert rows[f"{many['id']}-1"]["reward"] == -1.0
        assert {r["response_id"] for r in rows.values()} == {chat["id"], text["id"], many["id"]}
        # No --proxy-id: its own engine's tokens are "proxy"'s, one run from the first one.
        for r in rows.values():
            assert r["replicas"] == [[r["loss_mask"].index(1), "proxy"]], r
            # One certified span, which the client's hash holds to its prefix.
            [(at, end, phash)] = r["spans"]
            assert (at, end) == (r["loss_mask"].index(1), len(r["input_ids"]))
            assert phash == prompt_hash(r["input_ids"][:at])
            assert uncertified_spans(r["input_ids"], r["spans"]) == []
            assert r["tool_calls"] == {"declared": 0, "called": 0, "parsed": 0}
            assert r["side"] is False
        # Every turn a chain of its own: the first is the root; the completion comes after it
        # unlinked, and the choices of a request whose messages extend no turn are a new
        # conversation of the session.
        chains = {
            iid: (r["chain_id"], r["chain_reason"], r["parent_chain"]) for iid, r in rows.items()
        }
        assert chains[chat["id"]] == (chat["id"], "root", "")
        assert chains[text["id"]] == (text["id"], "unlinked", chat["id"])
        for i in range(3):
            iid = f"{many['id']}-{i}"
            assert chains[iid] == (iid, "new_conversation", text["id"])
    finally:
        await h.close()
