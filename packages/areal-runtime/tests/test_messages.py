"""The canonical form of a chat message (areal_runtime.openai.messages): what harnesses
change when they echo a message back and what it means is kept apart."""

from __future__ import annotations

import json
from typing import Any

from areal_runtime.openai.messages import canonical, prefix_hashes


def _call(arguments: Any, *, name: str = "bash", call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _answer(*calls: dict[str, Any], content: Any = None) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


ARGS = {"command": "ls -la", "timeout": 30, "env": {"B": "2", "A": "1"}, "ratio": 0.5}


def test_arguments_compare_as_parsed_json():
    sent = canonical(_answer(_call(json.dumps(ARGS))))
    # JavaScript harnesses parse and write them again: compact, keys in their own order.
    compact = json.dumps(ARGS, separators=(",", ":"))
    reordered = json.dumps(dict(reversed(list(ARGS.items()))), indent=2)
    escaped = json.dumps({**ARGS, "command": "ls -la"}, ensure_ascii=True)
    for echo in (compact, reordered, escaped, ARGS):  # ARGS: an object sent unserialized
        assert canonical(_answer(_call(echo))) == sent
    # A number written as JavaScript writes it (30.0 -> 30, 5e-1 -> 0.5) is the same number.
    spelled = json.dumps(ARGS).replace("30", "30.0").replace("0.5", "5e-1")
    assert canonical(_answer(_call(spelled))) == sent
    # Different values are different calls.
    assert canonical(_answer(_call(json.dumps({**ARGS, "timeout": 31})))) != sent
    assert canonical(_answer(_call(json.dumps({**ARGS, "ratio": 0.25})))) != sent
    assert canonical(_answer(_call(json.dumps(ARGS), name="sh"))) != sent
    assert canonical(_answer(_call(json.dumps([1, 2])))) != canonical(_answer(_call("[2,1]")))


def test_unparsable_arguments_compare_as_the_raw_string():
    raw = '{"command": "ls'  # cut short
    assert canonical(_answer(_call(raw))) == canonical(_answer(_call(raw)))
    assert canonical(_answer(_call(raw))) != canonical(_answer(_call(raw + " ")))
    # The text x is not the JSON string "x".
    assert canonical(_answer(_call("x"))) != canonical(_answer(_call('"x"')))
    # No arguments, however written.
    none = canonical(_answer(_call("{}")))
    assert canonical(_answer(_call(""))) == canonical(_answer(_call(None))) == none


def test_echo_differences_that_change_nothing():
    sent = _answer(_call('{"a": 1}'), content=None)
    same = [
        _answer(_call('{"a":1}', call_id="call_mine"), content=""),  # own id, "" for null
        {**_answer(_call('{"a": 1}')), "reasoning_content": "split off"},
        {
            "role": "assistant",
            "content": [],
            "tool_calls": [{"function": sent["tool_calls"][0]["function"]}],
        },
    ]
    for echo in same:
        assert canonical(echo) == canonical(sent)
    text = {"role": "assistant", "content": "Done.\n"}
    assert canonical({"role": "assistant", "content": "Done."}) == canonical(text)
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert canonical(parts) == canonical({"role": "user", "content": "a\nb"})
    # Whitespace of what a user or a tool wrote is theirs: a change.
    assert canonical({"role": "user", "content": "hi "}) != canonical(
        {"role": "user", "content": "hi"}
    )
    assert canonical({"role": "tool", "content": "1\n"}) != canonical(
        {"role": "tool", "content": "1"}
    )
    # The calls' order, the role, the text count.
    two = _answer(_call('{"a": 1}'), _call('{"b": 2}'))
    assert canonical(two) != canonical(_answer(_call('{"b": 2}'), _call('{"a": 1}')))
    assert canonical({"role": "user", "content": "x"}) != canonical(
        {"role": "system", "content": "x"}
    )


def test_deeply_nested_arguments_still_hash():
    deep = "[" * 300 + "]" * 300
    assert canonical(_answer(_call(deep))) == canonical(_answer(_call(deep)))


def test_prefix_hashes_of_an_echoed_conversation_are_the_originals():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        _answer(_call(json.dumps(ARGS))),
        {"role": "tool", "tool_call_id": "call_1", "content": "out"},
    ]
    echoed = [
        *msgs[:2],
        _answer(_call(json.dumps(ARGS, separators=(",", ":")), call_id="x")),
        msgs[3],
    ]
    assert prefix_hashes(echoed) == prefix_hashes(msgs)
    assert len(set(prefix_hashes(msgs))) == 4
