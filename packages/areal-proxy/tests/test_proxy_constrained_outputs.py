"""What a JSON-schema generation sends and answers: length-bounded strings as patterns the
grammar holds to JSON, and an output that is JSON and meets the schema (or no answer)."""

from __future__ import annotations

import re
from typing import Any

import grpc
import pytest
from proxy_fakes import EOS, FakeEngineClient, error_detail, start

from areal_proxy.output.structured_json import check, engine_schema
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
    # Past 2,048 the bound is not written as a pattern: the length stays as it is (the
    # final check still refuses a raw control character).
    for long in ({"minLength": 3000}, {"maxLength": 2049}):
        kept = {"type": "string", **long}
        assert (
            engine_schema({"type": "object", "properties": {"x": kept}}, "r")["properties"]["x"]
            == kept
        )


@pytest.mark.parametrize(
    ("low", "high"), [(3, 200), (0, 129), (1, 256), (130, None), (300, 2048), (128, 128)]
)
def test_a_length_past_128_is_still_given_to_the_grammar(low, high):
    # The engines' grammar backend compiles no repetition over 128 (xgrammar 0.2.7), so a
    # longer bound is written as several: the pattern still takes exactly low..high.
    bounds: dict[str, Any] = {"minLength": low} if low else {}
    if high is not None:
        bounds["maxLength"] = high
    got = engine_schema({"type": "string", **bounds}, "response_format")
    assert set(got) == {"type", "pattern"}
    assert all(int(n) <= 128 for n in re.findall(r"(\d+)[,}]", got["pattern"]))
    # (Matched here with possessive repetitions: the same strings, without the backtracking
    # Python's re would spend on a string one too long; the engine's grammar is an automaton.)
    rx = re.compile(got["pattern"].replace("}", "}+").replace("*", "*+"))
    top = high if high is not None else low + 300
    for n in {0, 1, low - 1, low, low + 1, top - 1, top, top + 1}:
        if n < 0:
            continue
        want = low <= n and (high is None or n <= high)
        assert bool(rx.fullmatch("é" * n)) == want, n
    assert not rx.fullmatch("a" * (low - 1) + "\x01" + "a" * max(0, 2 - low))


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
        ('{"s": "abcdefghij"}', "too long (maxLength 8)"),
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
    assert "abcdefghij" not in (got or "")  # the schema's words, never the output's


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


async def test_an_engine_failure_is_told_in_the_services_words_not_the_engines():
    # What SGLang's grammar backend says when a constrained generation fails mid-way, as its
    # stream reports it: the client gets what failed and what to do, the log the words.
    raw = (
        "engine error during generation: [12:01:02] /project/cpp/grammar_matcher.cc:411: "
        "Check failed: (!IsStopTokenAccepted()) at http://10.1.2.3:30000/generate"
    )
    from areal_proxy.engine.base import EngineError

    h = await start(FakeEngineClient([], fail=EngineError(raw, status=502)))
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    try:
        for stream in (False, True):
            call = h.chat_stream if stream else h.chat
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await call({"messages": MSG, "response_format": fmt})
            d = error_detail(ei.value)
            assert (d.http_status, d.code) == (502, "engine_error"), d.message
            assert "send the request again" in d.message
            assert "grammar_matcher" not in d.message and "10.1.2.3" not in d.message
    finally:
        await h.close()
