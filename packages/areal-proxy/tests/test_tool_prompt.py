"""No silent tools: a chat template that does not render `tools` (SmolLM2's) gets them written
by the proxy in the tool-call parser's format, or the request is a 400 naming `tools`; and
without --tool-call-parser the proxy picks the parser the template leaves no doubt about."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from proxy_fakes import EOS, PARROT, FakeEngineClient, error_detail, start

from areal_proto.proxy.v1 import proxy_pb2
from areal_proxy.output.parsers import OutputParser
from areal_proxy.prompt import tool_prompt
from areal_proxy.prompt.chat_template import ChatTemplate, ToolsNotRendered

# SmolLM2-135M-Instruct's chat template, as shipped: ChatML that never looks at `tools`.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PARROT_TEMPLATE = (PARROT / "chat_template.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def _template(source: str, parser: str = "") -> ChatTemplate:
    t = ChatTemplate(source, bos_token="", eos_token="<|im_end|>")
    t.tool_parser = parser
    return t


def test_the_probe_tells_a_template_that_ignores_tools():
    assert _template(SMOL_TEMPLATE).renders_tools is False
    assert _template(PARROT_TEMPLATE).renders_tools is True


def test_the_default_parser_is_chosen_only_where_the_template_leaves_no_doubt():
    assert tool_prompt.default_tool_parser(PARROT_TEMPLATE, True) == "hermes"  # <tool_call>
    assert tool_prompt.default_tool_parser(SMOL_TEMPLATE, False) == "hermes"  # our prompt
    llama_like = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"
    assert tool_prompt.default_tool_parser(llama_like, True) == ""


def test_tools_are_written_into_the_system_prompt_in_the_parsers_format():
    t = _template(SMOL_TEMPLATE, "hermes")
    plain = t.render(MSG)
    text = t.render(MSG, tools=TOOLS)
    assert text != plain and "SmolLM" not in text  # our system message replaces the default
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    # The example call in the prompt, its type markers filled, is one the active parser reads
    # back as a call.
    example = text.split("for example:\n", 1)[1].split("\nIn a call", 1)[0]
    assert '"arguments": {"city": <string>}' in example
    parsed = OutputParser("hermes", None, TOOLS).parse(example.replace("<string>", '"Paris"'))
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    # A system message of the client's own keeps its text, the tools follow it.
    with_system = t.render([{"role": "system", "content": "Be brief."}, *MSG], tools=TOOLS)
    assert "<|im_start|>system\nBe brief.\n\nYou can call these tools" in with_system


def test_the_example_call_shows_types_and_example_values_never_dots():
    # A model copied the old example's "..." into forced calls ({"name": "...", ...}): the
    # example shows each argument's type, bare (not a JSON value, so a call constrained to
    # JSON cannot copy it), or the schema's own example value.
    params = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "country": {"type": "string", "enum": ["FR", "IT"]},
            "age": {"type": "integer"},
            "score": {"type": ["number", "null"]},
            "vip": {"type": "boolean", "default": False},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {
                "type": "object",
                "properties": {"zip": {"type": "string", "examples": ["75001"]}},
            },
        },
    }
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": params}}]
    section = tool_prompt.tool_section(tools, "hermes")
    example = section.split("for example:\n", 1)[1].split("\nIn a call", 1)[0]
    assert "..." not in section
    assert (
        '{"name": <string>, "country": "FR", "age": <integer>, "score": <number>, '
        '"vip": false, "tags": [<string>], "where": {"zip": "75001"}}' in example
    )
    assert "real value" in section


def test_the_tool_loop_is_put_in_words_the_model_follows():
    """SmolLM2, shown its own call and a `tool` turn, repeated the call at temperature 0;
    shown the result as a user turn naming the tool, it answered."""
    t = _template(SMOL_TEMPLATE, "hermes")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *MSG,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = t.render(history, tools=TOOLS)
    assert "<|im_start|>assistant\n<|im_end|>" in text
    assert "<|im_start|>user\nThe tool get_weather answered: sunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("parser", ["", "mistral"])
def test_without_a_prompt_format_the_tools_are_refused_not_dropped(parser):
    with pytest.raises(ToolsNotRendered, match="does not render 'tools'"):
        _template(SMOL_TEMPLATE, parser).render(MSG, tools=TOOLS)


def test_a_template_that_renders_tools_is_left_as_it_is():
    t = _template(PARROT_TEMPLATE, "hermes")
    assert "You can call these tools" not in t.render(MSG, tools=TOOLS)


# ---- through the proxy ----------------------------------------------------------------


@pytest.fixture
def smol_like(tmp_path: Path) -> Path:
    """The parrot's tokenizer with SmolLM2's chat template."""
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(PARROT / name, tmp_path / name)
    cfg = json.loads((PARROT / "tokenizer_config.json").read_text())
    cfg["chat_template"] = SMOL_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


async def test_a_proxy_without_a_parser_flag_renders_and_parses_tools(smol_like):
    h = await start(FakeEngineClient([]), tokenizer_path=str(smol_like))
    try:
        assert h.server.servicer.handler.config.tool_call_parser == "hermes"
        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        h.engine.sequence = [*h.tok.encode(call), EOS]
        plain = await h.chat({"messages": MSG, "max_tokens": 200})
        h.engine._prompt_len = None  # the fake plays its sequence again for a new prompt
        out = await h.chat({"messages": MSG, "tools": TOOLS, "max_tokens": 200})
        # The tools reached the prompt (they used to vanish: the same prompt_tokens).
        assert out["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
        (msg,) = [c["message"] for c in out["choices"]]
        assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
        assert out["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        await h.close()


async def test_a_proxy_told_no_parser_refuses_tools_it_cannot_render(smol_like):
    h = await start(
        FakeEngineClient([5, EOS]), tokenizer_path=str(smol_like), tool_call_parser="none"
    )
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.chat({"messages": MSG, "tools": TOOLS})
        d = error_detail(info.value)
        assert (d.http_status, d.param) == (400, "tools")
        assert "--tool-call-parser" in d.message
        assert h.engine.requests == []
        await h.chat({"messages": MSG})  # without tools it answers as before
    finally:
        await h.close()


async def test_get_stats_says_which_parsers_are_in_force_and_whether_tools_are_prompted(smol_like):
    """`areal inf status` shows these per replica: which parser is in force."""
    h = await start(FakeEngineClient([]), tokenizer_path=str(smol_like), reasoning_parser="qwen3")
    try:
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert (stats.tool_call_parser, stats.reasoning_parser) == ("hermes", "qwen3")
        assert stats.default_tool_prompt  # SmolLM2's template ignores `tools`
    finally:
        await h.close()
    # A template that renders tools itself, with the parser given on the command line.
    h = await start(FakeEngineClient([]), tool_call_parser="qwen25")
    try:
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert (stats.tool_call_parser, stats.reasoning_parser) == ("qwen25", "")
        assert not stats.default_tool_prompt
    finally:
        await h.close()
    # Told no parser: tools are refused (a 400 naming them), so no prompt is in force either.
    h = await start(FakeEngineClient([]), tokenizer_path=str(smol_like), tool_call_parser="none")
    try:
        stats = await h.status.GetStats(proxy_pb2.GetStatsRequest())
        assert stats.tool_call_parser == "" and not stats.default_tool_prompt
    finally:
        await h.close()
