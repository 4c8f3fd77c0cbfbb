"""Incremental detokenization, stop-string holding, chat template, token bytes, settings."""

from __future__ import annotations

import pytest
from proxy_fakes import PARROT

from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine import make_engine_client
from areal_proxy.engine.sglang import SGLangClient
from areal_proxy.output.stop_strings import StopChecker, truncate_at_stop
from areal_proxy.prompt.chat_template import ChatTemplate, PromptBuilder, TemplateError
from areal_proxy.settings import load_settings

MULTIBYTE = "héllo 你好 🌍 ok ñ€𝄞!"


@pytest.fixture(scope="module")
def tok() -> ModelTokenizer:
    return ModelTokenizer.from_dir(PARROT)


def test_model_files(tok):
    assert tok.eos_token_ids == [2]
    assert tok.eos_token == "<|im_end|>" and tok.bos_token is None
    assert tok.context_length == 2048
    assert tok.chat_template and "im_start" in tok.chat_template
    assert tok.vocab_size == 512


def test_incremental_detokenizer_never_splits_a_character(tok):
    ids = tok.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE) // 2  # multibyte characters span several tokens
    for step in (1, 2, 3):
        d = tok.detokenizer()
        pieces = [d.feed(ids[i : i + step]) for i in range(0, len(ids), step)]
        pieces.append(d.flush())
        assert "".join(pieces) == MULTIBYTE
        for p in pieces:
            assert "\ufffd" not in p
            p.encode("utf-8")  # a complete string


def test_detokenizer_flushes_an_incomplete_character(tok):
    ids = tok.encode("a你")
    d = tok.detokenizer()
    assert d.feed(ids[:1]) == "a"
    assert d.feed(ids[1:-1]) == ""  # held back: the character is not complete
    assert d.flush() == "\ufffd"


def test_detokenizer_skips_special_tokens(tok):
    ids = [*tok.encode("hi"), 2]
    assert tok.detokenizer().feed(ids) == "hi"
    assert tok.detokenizer(skip_special_tokens=False).feed(ids) == "hi<|im_end|>"


def test_token_bytes_join_to_the_text(tok):
    ids = tok.encode(MULTIBYTE)
    assert b"".join(tok.token_bytes(t) for t in ids).decode() == MULTIBYTE
    assert tok.token_bytes(2) == b"<|im_end|>"


def test_stop_checker_holds_back_a_possible_prefix():
    s = StopChecker(["END", "xyz"])
    assert s.feed("abcE") == ("abc", False)
    assert s.feed("N") == ("", False)
    assert s.feed("D tail") == ("", True)
    s = StopChecker(["END"])
    assert s.feed("abE") == ("ab", False)
    assert s.feed("x") == ("Ex", False)
    assert s.feed("E") == ("", False)
    assert s.flush() == "E"
    assert truncate_at_stop("a xyz b END", ["END", "xyz"]) == ("a ", True)
    assert truncate_at_stop("abc", ["d"]) == ("abc", False)


def test_chat_template_renders_chatml(tok):
    pb = PromptBuilder(tok)
    text = pb.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = pb.prompt_ids([{"role": "user", "content": "hi"}])
    assert ids[-1] == tok.encode("\n")[0] and ids[0] == 1


def test_chat_template_tools_use_tojson(tok):
    tools = [{"type": "function", "function": {"name": "f", "description": "é"}}]
    text = PromptBuilder(tok).render([{"role": "user", "content": "x"}], tools)
    assert '{"type": "function", "function": {"name": "f", "description": "é"}}' in text


def test_chat_template_raise_exception_and_vars():
    t = ChatTemplate(
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}{{ add_generation_prompt }}",
        bos_token="<s>",
        eos_token="</s>",
    )
    assert t.render([{"role": "user", "content": "x"}]) == "<s>x</s>True"
    with pytest.raises(TemplateError, match="one message only"):
        t.render([{"role": "user", "content": "x"}] * 2)


def test_template_sandbox_refuses_attribute_escape():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}", bos_token=None, eos_token=None)
    with pytest.raises(TemplateError):
        t.render([])


def test_concat_without_session_is_hf(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert PromptBuilder(tok, template_type="concat").prompt_ids(msgs) == PromptBuilder(
        tok, template_type="hf"
    ).prompt_ids(msgs)


def test_settings_flags_env_and_required(monkeypatch):
    monkeypatch.setenv("AREAL_PROXY_ENGINE_MAX_TOKENS", "64")
    monkeypatch.setenv("AREAL_PROXY_MODEL", "from-env")
    s = load_settings(
        [
            "--engine-url",
            "http://127.0.0.1:1",
            "--model",
            "m",
            "--tokenizer-path",
            "x",
            "--engine",
            "vllm",
        ]
    )
    assert (s.model, s.engine, s.engine_max_tokens, s.chat_template_type) == (
        "m",
        "vllm",
        64,
        "concat",
    )
    assert (s.port, s.metrics_port, s.drain_timeout, s.request_timeout) == (0, 0, 10.0, 3600.0)
    assert s.problems() == []
    assert load_settings([]).problems() == [
        "--engine-url is required",
        "--tokenizer-path is required",
    ]
    with pytest.raises(SystemExit):
        load_settings(["--chat-template-type", "weird"])


def test_make_engine_client():
    assert isinstance(make_engine_client("sglang", "http://127.0.0.1:1", 5), SGLangClient)
    vllm = make_engine_client("vllm", "http://127.0.0.1:1/", 5)
    assert type(vllm).__name__ == "VLLMClient" and vllm.base_url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine_client("tgi", "http://127.0.0.1:1")


def test_a_template_without_tool_calls_renders_a_tool_call_turn_with_empty_content():
    # SmolLM2's shape: content concatenated as a string, no idea of tool_calls.
    source = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n"
        "{% endif %}"
    )
    t = ChatTemplate(source, bos_token=None, eos_token=None)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    out = t.render(msgs)
    assert "<|im_start|>assistant\n<|im_end|>" in out and "<|im_start|>tool\n42" in out
    assert msgs[1]["content"] is None  # the caller's messages (what is recorded) untouched
    with pytest.raises(TemplateError):  # a failure with no null content is still an error
        t.render([{"role": "user", "content": 5}])
