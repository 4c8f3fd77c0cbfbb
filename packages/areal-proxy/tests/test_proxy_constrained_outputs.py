"""What a constrained generation records and answers: a forced tool call's fixed text as the
tokenizer's own ids, and a JSON-schema output that is JSON and meets the schema (or no answer).

The fake engines here follow the constraint the proxy sends the way a weak policy sampled at
temperature 1 does where the grammar leaves it free: they spell text one character a token.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, start

from areal_proxy.engine.base import GenerationRequest
from areal_proxy.structured_json import check, engine_schema
from areal_runtime.errors import InvalidRequest

MSG = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
ARGS = '{"city": "Rome"}'


class SpellingEngine(FakeEngineClient):
    """Writes what the structural tag allows, one character a token wherever the grammar
    lets text be spelled freely (a forced token id is the only token it may write there)."""

    tok: Any = None  # the proxy's tokenizer, set once the proxy is up

    def _spell(self, text: str) -> list[int]:
        return [i for ch in text for i in self.tok.encode(ch)]

    def _walk(self, fmt: dict[str, Any]) -> list[int]:
        kind = fmt["type"]
        if kind == "token":
            return [fmt["token"]]
        if kind == "const_string":
            return self._spell(fmt["value"])
        if kind == "json_schema":
            return self._spell(ARGS)
        if kind == "sequence":
            return [i for e in fmt["elements"] for i in self._walk(e)]
        if kind == "or":
            return self._walk(fmt["elements"][0])
        if kind == "star":
            return []
        if kind == "tags_with_separator":  # a text-level call: its text spelled out
            tag = fmt["tags"][0]
            return self._spell(tag["begin"] + ARGS + tag["end"])
        raise AssertionError(f"unexpected format {kind}")

    async def generate_stream(self, req: GenerationRequest):  # type: ignore[override]
        assert req.constraint is not None and req.constraint[0] == "structural_tag"
        self.sequence = [*self._walk(json.loads(req.constraint[1])["format"]), EOS]
        async for chunk in super().generate_stream(req):
            yield chunk


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_a_forced_calls_fixed_text_is_recorded_as_the_tokenizers_own_ids(choice, stream):
    engine = SpellingEngine([])
    h = await start(engine, tool_call_parser="hermes")
    engine.tok = h.tok
    try:
        body = {"messages": MSG, "tools": TOOLS, "tool_choice": choice}
        if stream:
            await h.chat_stream(body)
        else:
            out = await h.chat(body)
            (call,) = out["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
            assert out["choices"][0]["finish_reason"] == "tool_calls"
        (rec,) = h.records
        head = h.tok.encode('<tool_call>\n{"name": "get_weather", "arguments":')
        tail = h.tok.encode("\n</tool_call>")
        # The scaffold is the tokenizer's encoding of it, not its text spelled one character
        # a token; what sits between (the seam and the arguments) is the model's own.
        assert rec.token_ids[: len(head)] == head
        assert rec.token_ids[-len(tail) - 1 :] == [*tail, EOS]
        middle = rec.token_ids[len(head) : -len(tail) - 1]
        assert h.tok.decode(middle) == " " + ARGS + "}"
        assert len(rec.logprobs) == len(rec.token_ids)
    finally:
        await h.close()


# ---- JSON-schema outputs -----------------------------------------------------------------


def test_a_length_bounded_string_goes_to_the_engine_as_a_pattern_without_control_chars():
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "maxLength": 8},
            "t": {"type": "string", "minLength": 2},
            "list": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}},
            "fixed": {"type": "string", "enum": ["a", "b"], "maxLength": 1},
            "free": {"type": "string"},
        },
    }
    got = engine_schema(schema, "response_format")
    char = r'[^\u0000-\u001f"\\\ud800-\udfff]'
    assert got["properties"]["s"] == {"type": "string", "pattern": f"^{char}{{0,8}}$"}
    assert got["properties"]["t"] == {"type": "string", "pattern": f"^{char}{{2,}}$"}
    assert got["properties"]["list"]["items"]["pattern"] == f"^{char}{{1,3}}$"
    assert got["properties"]["fixed"] == schema["properties"]["fixed"]
    assert got["properties"]["free"] == {"type": "string"}
    assert schema["properties"]["s"] == {"type": "string", "maxLength": 8}  # not changed


def test_a_pattern_with_a_length_is_refused_naming_what_to_do():
    with pytest.raises(InvalidRequest) as ei:
        engine_schema(
            {
                "type": "object",
                "properties": {"x": {"type": "string", "pattern": "^a+$", "maxLength": 3}},
            },
            "response_format",
        )
    assert (
        ei.value.param == "response_format" and "put the length in the pattern" in ei.value.message
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"s": "ab"}', None),
        ('{"s": "a\tb"}', "not JSON"),  # a raw control character (what xgrammar let through)
        ('{"s": "abcdefghij"}', "too long"),
        ('{"s": NaN}', "not JSON"),
        ('{"s": "ab"', "not JSON"),
        ("{}", "required"),
    ],
)
def test_check_says_why_an_output_is_not_valid(text, why):
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 8}},
        "required": ["s"],
    }
    got = check(schema, text)
    assert (got is None) if why is None else (why in (got or "")), got


SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 4}},
    "required": ["s"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "completion"])
async def test_an_output_that_breaks_the_schema_is_a_502_and_is_not_recorded(api, stream):
    h = await start(FakeEngineClient([]))
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    try:
        for text, ok in (
            ('{"s": "ab"}', True),
            ('{"s": "a\x04b"}', False),
            ('{"s": "abcde"}', False),
        ):
            h.engine.sequence = [*h.tok.encode(text), EOS]
            body: dict[str, Any] = {"response_format": fmt}
            body.update({"messages": MSG} if api == "chat" else {"prompt": "x"})
            call = getattr(h, f"{api}_stream" if stream else api)
            if ok:
                await call(body)
                continue
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call(body)
            d = error_detail(ei.value)
            assert (d.http_status, d.code) == (502, "invalid_structured_output"), d.message
            assert "send the request again" in d.message
    finally:
        await h.close()


async def test_a_cut_json_output_is_returned_with_finish_length():
    h = await start(FakeEngineClient([]))
    h.engine.sequence = h.tok.encode('{"s": "abcd", "t": 1}')
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    try:
        out = await h.chat({"messages": MSG, "response_format": fmt, "max_tokens": 3})
        assert out["choices"][0]["finish_reason"] == "length"
    finally:
        await h.close()
