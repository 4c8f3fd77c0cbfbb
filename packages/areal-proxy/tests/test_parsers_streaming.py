"""Streaming equals whole-output parsing for any split of the text."""

from __future__ import annotations

import itertools
import random

import pytest
from test_parsers_cases import CASES, TOOLS

from areal_proxy.output.parsers import (
    ContentDelta,
    OutputParser,
    ParsedOutput,
    ReasoningDelta,
    ToolCallDelta,
)


def _stream(parser: OutputParser, pieces: list[str]) -> tuple[ParsedOutput, list]:
    streamer = parser.streamer()
    events = []
    for piece in pieces:
        events.extend(streamer.feed(piece))
    events.extend(streamer.finish())
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls: dict[int, list[str]] = {}
    order: list[int] = []
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.index not in calls:
                # First delta of a call carries its id and name.
                assert e.id is not None and e.name, e
                calls[e.index] = [e.name, ""]
                order.append(e.index)
            else:
                assert e.id is None and e.name is None
            calls[e.index][1] += e.arguments
        else:
            assert e.text, "empty text delta"
    assert order == list(range(len(order)))
    assert streamer.saw_tool_calls == bool(calls)
    summary = ParsedOutput(
        content=None if (not content and calls) else content,
        reasoning_content=reasoning or None,
        tool_calls=[],
    )
    return summary, [tuple(calls[i]) for i in order]


def _expected(parser: OutputParser, text: str):
    parsed = parser.parse(text)
    return (
        ParsedOutput(parsed.content, parsed.reasoning_content, []),
        [(c.name, c.arguments) for c in parsed.tool_calls],
    )


def _splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)  # one character at a time
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for _ in range(30 if len(text) > 2 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_any_split_matches_parse(case) -> None:
    name, tool_parser, reasoning_parser, text, *_ = case
    parser = OutputParser(tool_parser, reasoning_parser, TOOLS)
    expected = _expected(parser, text)
    rng = random.Random(name)
    for pieces in _splits(text, rng):
        assert _stream(parser, pieces) == expected, pieces


# Odd inputs a model can produce, streamed under every family.
FUZZ_TEXTS = [
    "<tool_call><tool_call>{}</tool_call></tool_call>",
    '<tool_call>{"name": "a"}</tool_call  ><tool_call>{"name": "b"}',
    "<think></think></think><think>",
    "   \n\t ",
    '{"name": "x", "parameters": {"a": "}"}} ;  {"name": "y"} ; ',
    '[TOOL_CALLS][TOOL_CALLS]x[ARGS]{"a": [}]}[TOOL_CALLS]y{}',
    "[TOOL_CALLS]   ",
    '<|python_tag|><|python_tag|>{"name": "z"}',
    "\uff5c\u2581<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>n\n```json\n{}\n```",
    'text\\" with "quotes {[ and escapes\\\\',
]


@pytest.mark.parametrize("tool_parser", ["hermes", "llama3", "mistral", "deepseekv3", None])
@pytest.mark.parametrize("reasoning_parser", ["qwen3", "deepseek-r1", None])
def test_fuzz_texts_all_families(tool_parser, reasoning_parser) -> None:
    parser = OutputParser(tool_parser, reasoning_parser, TOOLS)
    rng = random.Random(f"{tool_parser}/{reasoning_parser}")
    for text in FUZZ_TEXTS:
        expected = _expected(parser, text)
        for pieces in _splits(text, rng):
            assert _stream(parser, pieces) == expected, (text, pieces)


def test_random_generated_outputs() -> None:
    """Random concatenations of marker fragments and JSON bits, every family."""
    atoms = [
        "<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]",
        "<|python_tag|>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>",
        "<\uff5ctool\u2581call\u2581end\uff5c>", '{"name": "f", ', '"arguments": {"a": 1}}',
        '"parameters": {}}', "{", "}", "[", "]", '"', "\\", ";", " ", "\n", "hi", "é🚀",
        "function", "```json\n", "```", "<", "<tool_",
    ]  # fmt: skip
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 14)))
        for tool_parser in ["hermes", "llama3", "mistral", "deepseekv3", "deepseekv31"]:
            for reasoning_parser in ["qwen3", "deepseek-r1", None]:
                parser = OutputParser(tool_parser, reasoning_parser, TOOLS)
                expected = _expected(parser, text)
                for pieces in (list(text), *[[text[:i], text[i:]] for i in range(1, len(text))]):
                    assert _stream(parser, pieces) == expected, (tool_parser, text, pieces)
