"""Model output samples and their expected parse, shared by the parser tests (no tests here).

Each case: (id, tool_parser, reasoning_parser, text, content, reasoning, calls)
where calls is a list of (name, arguments as a Python object).
"""

from __future__ import annotations

import json
from typing import Any

# DeepSeek markers (full-width bars and U+2581), spelled with escapes.
DS_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"


def ds_v3_call(name: str, args: str) -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


def ds_v31_call(name: str, args: str) -> str:
    return f"{DS_CALL_BEGIN}{name}{DS_SEP}{args}{DS_CALL_END}"


WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {
    "query": {"filters": [{"field": "tag", "op": "in", "value": ["a", "b"]}], "limit": 5},
    "options": {"verbose": True, "score": 0.5, "none": None},
    "text": 'quote " brace } bracket ] and </tool_call> inside a string',
}
UNICODE = {"city": "東京", "note": "naïve café ☕ 🚀", "escaped": "\u00e9"}

Case = tuple[str, str | None, str | None, str, str | None, str | None, list[tuple[str, Any]]]


def _j(obj: Any, compact: bool = False) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":") if compact else None)


CASES: list[Case] = [
    # ---------------------------------------------------------------- hermes
    (
        "hermes-single",
        "hermes",
        None,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {_j(WEATHER)}}}\n</tool_call>',
        None,
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes-text-before-two-calls",
        "hermes",
        None,
        "Let me check both cities.\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {_j(WEATHER)}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "Let me check both cities.",
        None,
        [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})],
    ),
    (
        "hermes-text-after",
        "hermes",
        None,
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone, waiting.',
        "\nDone, waiting.",
        None,
        [("f", {})],
    ),
    (
        "hermes-nested-unicode",
        "qwen25",
        None,
        f'Voilà 🚀\n<tool_call>\n{{"name": "search", "arguments": {_j(NESTED)}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "weather", "arguments": {_j(UNICODE)}}}\n</tool_call>\n',
        "Voilà 🚀",
        None,
        [("search", NESTED), ("weather", UNICODE)],
    ),
    (
        "hermes-no-arguments",
        "hermes",
        None,
        '<tool_call>{"name": "ping"}</tool_call>',
        None,
        None,
        [("ping", {})],
    ),
    (
        "hermes-string-arguments",
        "hermes",
        None,
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        None,
        None,
        [("f", {"x": 1})],
    ),
    (
        "hermes-malformed-json",
        "hermes",
        None,
        'Try: <tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
        'Try: <tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
        None,
        [],
    ),
    (
        "hermes-malformed-then-good",
        "hermes",
        None,
        '<tool_call>{"name": 3}</tool_call>\n<tool_call>{"name": "g", "arguments": {"k": [1, 2]}}</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
        None,
        [("g", {"k": [1, 2]})],
    ),
    (
        "hermes-unclosed-valid",
        "hermes",
        None,
        'Sure <tool_call>\n{"name": "f", "arguments": {"a": "b"}}\n',
        "Sure",
        None,
        [("f", {"a": "b"})],
    ),
    (
        "hermes-truncated",
        "hermes",
        None,
        'Sure <tool_call>\n{"name": "f", "arguments": {"a": "b',
        # Cut off by max_tokens: the call is dropped, its markup never shown as content.
        "Sure ",
        None,
        [],
    ),
    (
        "hermes-nan-rejected",
        "hermes",
        None,
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        None,
        [],
    ),
    (
        "hermes-lookalike-tags",
        "hermes",
        None,
        "Use <tool_cal and <tool_ or </tool_call> freely; <b>bold</b> <",
        "Use <tool_cal and <tool_ or </tool_call> freely; <b>bold</b> <",
        None,
        [],
    ),
    (
        "hermes-plain-text",
        "hermes",
        None,
        "Just an answer.\n\nWith paragraphs.  \n",
        "Just an answer.\n\nWith paragraphs.  \n",
        None,
        [],
    ),
    ("hermes-empty", "hermes", None, "", "", None, []),
    # ---------------------------------------------------------------- llama3
    (
        "llama3-bare",
        "llama3",
        None,
        f'{{"name": "get_weather", "parameters": {_j(WEATHER)}}}',
        None,
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3-python-tag",
        "llama3",
        None,
        f'<|python_tag|>{{"name": "search", "parameters": {_j(NESTED)}}}',
        None,
        None,
        [("search", NESTED)],
    ),
    (
        "llama3-text-then-tag",
        "llama3",
        None,
        f'I will look it up. <|python_tag|>{{"name": "w", "parameters": {_j(UNICODE)}}}',
        "I will look it up.",
        None,
        [("w", UNICODE)],
    ),
    (
        "llama3-multiple",
        "llama3",
        None,
        ' {"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}};{"name":"c","parameters":{}}',
        None,
        None,
        [("a", {"x": 1}), ("b", {"y": [2]}), ("c", {})],
    ),
    (
        "llama3-json-answer-not-call",
        "llama3",
        None,
        '{"answer": 42, "unit": "none"}',
        '{"answer": 42, "unit": "none"}',
        None,
        [],
    ),
    (
        "llama3-brace-mid-text",
        "llama3",
        None,
        'The JSON is {"name": "f", "parameters": {}} as shown.',
        'The JSON is {"name": "f", "parameters": {}} as shown.',
        None,
        [],
    ),
    (
        "llama3-call-then-garbage",
        "llama3",
        None,
        '{"name": "a", "parameters": {}}; oops',
        "; oops",
        None,
        [("a", {})],
    ),
    (
        "llama3-malformed",
        "llama3",
        None,
        '{"name": "a", "parameters": {"x": }}',
        '{"name": "a", "parameters": {"x": }}',
        None,
        [],
    ),
    (
        "llama3-truncated",
        "llama3",
        None,
        '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2',
        '<|python_tag|>{"name": "a", "parameters": {"x": [1, 2',
        None,
        [],
    ),
    (
        "llama3-builtin-python-tag",
        "llama3",
        None,
        '<|python_tag|>brave_search.call(query="weather")',
        '<|python_tag|>brave_search.call(query="weather")',
        None,
        [],
    ),
    # ---------------------------------------------------------------- mistral
    (
        "mistral-list",
        "mistral",
        None,
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {_j(WEATHER)}}}, '
        '{"name": "get_time", "arguments": {"tz": "UTC"}, "id": "a1b2c3d4e"}]',
        None,
        None,
        [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})],
    ),
    (
        "mistral-list-text-before",
        "mistral",
        None,
        f'Let me search.\n[TOOL_CALLS][{{"name": "search", "arguments": {_j(NESTED, True)}}}]',
        "Let me search.",
        None,
        [("search", NESTED)],
    ),
    (
        "mistral-v11-args",
        "mistral",
        None,
        f"[TOOL_CALLS]get_weather[ARGS]{_j(WEATHER)}[TOOL_CALLS]lookup[ARGS]{_j(UNICODE)}",
        None,
        None,
        [("get_weather", WEATHER), ("lookup", UNICODE)],
    ),
    (
        "mistral-v11-no-args-token-and-call-id",
        "mistral",
        None,
        'Ok.[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g[CALL_ID]abc123XYZ[ARGS]{"b": {"c": []}}',
        "Ok.",
        None,
        [("f", {"a": 1}), ("g", {"b": {"c": []}})],
    ),
    (
        "mistral-malformed-list",
        "mistral",
        None,
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]',
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}]',
        None,
        [],
    ),
    (
        "mistral-marker-then-prose",
        "mistral",
        None,
        '[TOOL_CALLS] I cannot call tools, sorry! {"x": 1}',
        '[TOOL_CALLS] I cannot call tools, sorry! {"x": 1}',
        None,
        [],
    ),
    (
        "mistral-truncated-v11",
        "mistral",
        None,
        '[TOOL_CALLS]f[ARGS]{"a": "unterminated',
        '[TOOL_CALLS]f[ARGS]{"a": "unterminated',
        None,
        [],
    ),
    # ---------------------------------------------------------------- deepseek
    (
        "deepseekv3-two-calls",
        "deepseekv3",
        None,
        "Checking.\n"
        + DS_CALLS_BEGIN
        + ds_v3_call("get_weather", _j(WEATHER))
        + "\n"
        + ds_v3_call("search", _j(NESTED))
        + DS_CALLS_END,
        "Checking.",
        None,
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    (
        "deepseekv3-unicode",
        "deepseekv3",
        None,
        DS_CALLS_BEGIN + ds_v3_call("weather", _j(UNICODE)) + DS_CALLS_END,
        None,
        None,
        [("weather", UNICODE)],
    ),
    (
        "deepseekv3-malformed",
        "deepseekv3",
        None,
        DS_CALLS_BEGIN + ds_v3_call("f", '{"a": }') + DS_CALLS_END,
        ds_v3_call("f", '{"a": }'),
        None,
        [],
    ),
    (
        "deepseekv31-form",
        "deepseekv31",
        None,
        DS_CALLS_BEGIN
        + ds_v31_call("get_weather", _j(WEATHER))
        + ds_v31_call("g", "{}")
        + DS_CALLS_END,
        None,
        None,
        [("get_weather", WEATHER), ("g", {})],
    ),
    # ---------------------------------------------------------------- reasoning
    (
        "qwen3-think-content",
        None,
        "qwen3",
        "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
        "Hello! How can I help?",
        "The user greets me.",
        [],
    ),
    (
        "qwen3-no-open-tag",
        None,
        "qwen3",
        "Reasoning without the opening tag.\n</think>\n\nAnswer.",
        "Answer.",
        "Reasoning without the opening tag.",
        [],
    ),
    (
        "qwen3-no-tags",
        None,
        "qwen3",
        "  Plain answer, no thinking.\n",
        "  Plain answer, no thinking.\n",
        None,
        [],
    ),
    (
        "qwen3-unclosed",
        None,
        "qwen3",
        "<think>\nStill thinking when the budget ran out",
        "",
        "Still thinking when the budget ran out",
        [],
    ),
    (
        "qwen3-empty-think",
        None,
        "qwen3",
        "<think>\n\n</think>\n\nDirect answer.",
        "Direct answer.",
        None,
        [],
    ),
    (
        "qwen3-lookalike",
        None,
        "qwen3",
        "<thinking> is not <think",
        "<thinking> is not <think",
        None,
        [],
    ),
    (
        "r1-no-open-tag",
        None,
        "deepseek-r1",
        "Okay, 2+2 is 4. </thi is not the end.\n</think>\n\nThe answer is **4**.",
        "The answer is **4**.",
        "Okay, 2+2 is 4. </thi is not the end.",
        [],
    ),
    (
        "r1-with-open-tag",
        None,
        "deepseek-r1",
        "<think>思考中…</think>答案是 4。",
        "答案是 4。",
        "思考中…",
        [],
    ),
    (
        "r1-unclosed",
        None,
        "deepseek-r1",
        "All of this is reasoning",
        "",
        "All of this is reasoning",
        [],
    ),
    (
        "content-keeps-later-tags",
        None,
        "qwen3",
        "<think>a</think>b <think>c</think>",
        "b <think>c</think>",
        "a",
        [],
    ),
    # ---------------------------------------------------------- reasoning + tools
    (
        "qwen3-hermes",
        "hermes",
        "qwen3",
        "<think>\nI need the weather; <tool_call> is how I call.\n</think>\n\n"
        f'<tool_call>\n{{"name": "get_weather", "arguments": {_j(WEATHER)}}}\n</tool_call>',
        None,
        "I need the weather; <tool_call> is how I call.",
        [("get_weather", WEATHER)],
    ),
    (
        "qwen3-no-open-hermes-text",
        "qwen25",
        "qwen3",
        "Need two calls.</think>Calling now.\n"
        '<tool_call>\n{"name": "a", "arguments": {"n": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"n": 2}}\n</tool_call>',
        "Calling now.",
        "Need two calls.",
        [("a", {"n": 1}), ("b", {"n": 2})],
    ),
    (
        "r1-deepseekv3",
        "deepseekv3",
        "deepseek-r1",
        "The user wants weather.\n</think>\n\n"
        + DS_CALLS_BEGIN
        + ds_v3_call("get_weather", _j(WEATHER))
        + DS_CALLS_END,
        None,
        "The user wants weather.",
        [("get_weather", WEATHER)],
    ),
    (
        "qwen3-llama3-leading-brace-after-think",
        "llama3",
        "qwen3",
        '<think>x</think>\n{"name": "a", "parameters": {}}',
        None,
        "x",
        [("a", {})],
    ),
]

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]
