"""Whole-output parsing: each family's real output shapes, registry, API contract."""

from __future__ import annotations

import json
import re

import pytest
from test_parsers_cases import CASES, TOOLS

from areal_proxy.output.parsers import (
    ContentDelta,
    OutputParser,
    ParsedOutput,
    ReasoningDelta,
    ToolCallDelta,
    ToolParser,
    check_parser_names,
    reasoning_parser_names,
    register_reasoning_parser,
    register_tool_parser,
    tool_parser_names,
)
from areal_proxy.output.parsers.reasoning import ReasoningParser
from areal_proxy.output.parsers.tool_base import Region

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parse_cases(case) -> None:
    _, tool_parser, reasoning_parser, text, content, reasoning, calls = case
    parsed = OutputParser(tool_parser, reasoning_parser, TOOLS).parse(text)
    assert isinstance(parsed, ParsedOutput)
    assert parsed.content == content
    assert parsed.reasoning_content == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    for call in parsed.tool_calls:
        assert CALL_ID.fullmatch(call.id)
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


def test_known_names() -> None:
    assert {"hermes", "qwen25", "llama3", "mistral", "deepseekv3"} <= set(tool_parser_names())
    assert {"qwen3", "deepseek-r1"} <= set(reasoning_parser_names())


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        OutputParser("nope", None, TOOLS)
    for name in tool_parser_names():
        assert name in str(err.value)
    with pytest.raises(ValueError) as err:
        check_parser_names(None, "nope")
    for name in reasoning_parser_names():
        assert name in str(err.value)
    check_parser_names(None, None)
    check_parser_names("hermes", "qwen3")


HERMES_CALL = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'


@pytest.mark.parametrize("tools", [None, []])
def test_tool_parsing_off_without_tools(tools) -> None:
    parser = OutputParser("hermes", None, tools)
    assert not parser.tools_active
    assert parser.parse(HERMES_CALL) == ParsedOutput(HERMES_CALL, None, [])


def test_everything_off_is_identity() -> None:
    text = "<think>x</think> <tool_call>{}</tool_call>"
    assert OutputParser(None, None, TOOLS).parse(text) == ParsedOutput(text, None, [])


def test_reasoning_only_still_splits_without_tools() -> None:
    parsed = OutputParser("hermes", "qwen3", None).parse("<think>r</think>" + HERMES_CALL)
    assert parsed.reasoning_content == "r"
    assert parsed.content == HERMES_CALL
    assert parsed.tool_calls == []


def test_arguments_are_canonical_json() -> None:
    parsed = OutputParser("hermes", None, TOOLS).parse(
        '<tool_call>{"name":"f","arguments":{"b":[1,2],"s":"é"}}</tool_call>'
    )
    assert parsed.tool_calls[0].arguments == '{"b": [1, 2], "s": "é"}'


def test_streamer_events_shape() -> None:
    streamer = OutputParser("hermes", "qwen3", TOOLS).streamer()
    events = streamer.feed("<think>hm</think>Text ")
    assert events == [ReasoningDelta("hm"), ContentDelta("Text")]
    assert not streamer.saw_tool_calls
    events = streamer.feed(HERMES_CALL)
    assert streamer.saw_tool_calls
    first, second = events
    assert isinstance(first, ToolCallDelta) and isinstance(second, ToolCallDelta)
    assert first.index == 0 and first.name == "f" and CALL_ID.fullmatch(first.id or "")
    assert second.index == 0 and second.id is None and second.name is None
    assert json.loads(second.arguments) == {"a": 1}
    events = streamer.feed(HERMES_CALL)
    assert [e.index for e in events if isinstance(e, ToolCallDelta)] == [1, 1]
    assert streamer.finish() == []


def test_holds_only_possible_marker_starts() -> None:
    streamer = OutputParser("hermes", None, TOOLS).streamer()
    assert streamer.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert streamer.feed("ld <tool_") == [ContentDelta("ld")]  # " <tool_" could open a call
    assert streamer.feed("box") == [ContentDelta(" <tool_box")]  # ... and now cannot
    assert streamer.feed("<") == []
    assert streamer.feed("b>") == [ContentDelta("<b>")]
    assert streamer.finish() == []


def test_reasoning_streams_immediately_with_open_tag() -> None:
    streamer = OutputParser(None, "qwen3", None).streamer()
    assert streamer.feed("<think>\nStep one") == [ReasoningDelta("Step one")]
    assert streamer.feed(" </th") == []
    assert streamer.feed("ink>\n\nAns") == [ContentDelta("Ans")]
    assert streamer.finish() == []


def test_r1_streams_reasoning_without_open_tag() -> None:
    streamer = OutputParser(None, "deepseek-r1", None).streamer()
    assert streamer.feed("Let me think") == [ReasoningDelta("Let me think")]


def test_qwen3_without_open_tag_holds_until_decided() -> None:
    streamer = OutputParser(None, "qwen3", None).streamer()
    assert streamer.feed("maybe reasoning") == []
    assert streamer.feed("</think>ok") == [ReasoningDelta("maybe reasoning"), ContentDelta("ok")]
    streamer = OutputParser(None, "qwen3", None).streamer()
    assert streamer.feed("plain") == []
    assert streamer.finish() == [ContentDelta("plain")]


def test_feed_after_finish_raises() -> None:
    streamer = OutputParser("hermes", "qwen3", TOOLS).streamer()
    streamer.finish()
    with pytest.raises(RuntimeError):
        streamer.feed("x")


def test_registering_new_families() -> None:
    @register_tool_parser("test-bracket")
    class BracketParser(ToolParser):
        """CALL(name) — no arguments."""

        markers = ("CALL(",)

        def parse_region(self, marker: str, body: str, final: bool) -> Region | None:
            end = body.find(")")
            if end < 0:
                return None if not final else Region(len(body), None)
            name = body[:end]
            return Region(end + 1, [(name, "{}")] if name.isidentifier() else None)

    @register_reasoning_parser("test-reason")
    class ReasonParser(ReasoningParser):
        start_tag, end_tag = "<r>", "</r>"

    assert "test-bracket" in tool_parser_names()
    assert "test-reason" in reasoning_parser_names()
    parsed = OutputParser("test-bracket", "test-reason", TOOLS).parse(
        "<r>why</r>go CALL(ping) CALL(1x)"
    )
    assert parsed.reasoning_content == "why"
    assert parsed.content == "go CALL(1x)"
    assert [c.name for c in parsed.tool_calls] == ["ping"]
    with pytest.raises(ValueError):
        register_tool_parser("test-bracket")(type("Other", (ToolParser,), {}))


@pytest.mark.parametrize(
    "tail",
    [
        "<tool_",  # measured: SmolLM2 under `required`, cut by max_tokens inside the marker
        "\n<tool_call",
        "<tool_call>",
        "<tool_call>\n",
        '<tool_call>\n{"name": "get_weather", "argu',
        "<tool_call>\nnot json and no end tag",
    ],
)
def test_a_call_cut_off_by_max_tokens_never_leaks_into_content(tail) -> None:
    """SmolLM2 at t=0 under tool_choice required: whole calls, then `max_tokens` inside the
    next one. The whole calls are calls; the cut one is dropped, whole or streamed."""
    text = HERMES_CALL + HERMES_CALL + tail
    parsed = OutputParser("hermes", None, TOOLS).parse(text)
    assert len(parsed.tool_calls) == 2 and not parsed.content
    streamer = OutputParser("hermes", None, TOOLS).streamer()
    events = [e for ch in text for e in streamer.feed(ch)] + streamer.finish()
    assert not [e for e in events if isinstance(e, ContentDelta) and e.text.strip()]
    # Text before a cut call is kept.
    parsed = OutputParser("hermes", None, TOOLS).parse("Let me check. " + tail)
    assert parsed.content.rstrip() == "Let me check." and not parsed.tool_calls


@pytest.mark.parametrize(
    ("text", "made", "read"),
    [
        ("plain text", 0, 0),
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call>', 1, 1),
        # Not a call: left in the content, made and not read.
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>a()</tool_call>', 2, 1),
        # Cut inside a call, or inside its marker (max_tokens): dropped, made and not read.
        ('<tool_call>{"name": "a", "arguments": {"x": ', 1, 0),
        ("text <tool_", 1, 0),
    ],
)
def test_calls_made_and_read_are_counted(text: str, made: int, read: int) -> None:
    parser = OutputParser("hermes", None, TOOLS)
    parsed = parser.parse(text)
    assert (parsed.calls_made, len(parsed.tool_calls)) == (made, read)
    # Streamed in pieces, the streamer counts the same.
    streamer = parser.streamer()
    for i in range(0, len(text), 3):
        streamer.feed(text[i : i + 3])
    streamer.finish()
    assert streamer.call_counts == (made, read)
