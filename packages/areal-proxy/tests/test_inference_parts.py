"""The inference core's parts on their own: the text pipeline gives a whole answer what its
streamed pieces add up to (one set of stop-string, tool-call and finish-reason rules), and
building the core leaves its collaborators as their builder made them."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from proxy_fakes import EOS, PARROT, FakeEngineClient, start

from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.engine.base import GenerationRequest
from areal_proxy.generation.controller import GenerationController, GenerationRecord, Step
from areal_proxy.inference import InferenceConfig, InferenceHandler
from areal_proxy.inference.pipeline import TextPipeline
from areal_proxy.output.parsing import delta_dicts, make_output_parser
from areal_proxy.prompt.chat_template import PromptBuilder
from areal_proxy.prompt.incremental import SessionPrompts
from areal_proxy.recording.recorder import Recorder
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.recording.store import Store
from areal_runtime.openai import Sampling

TOK = ModelTokenizer.from_dir(PARROT)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class Aborts:
    """The controller as the pipeline sees it: an engine request aborted on a stop string."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_later(self, engine_rid: str) -> None:
        self.aborted.append(engine_rid)


def _record(ids: list[int], finish: str) -> GenerationRecord:
    rec = GenerationRecord("r", [1, 2], 1000)
    rec.engine_rid = "engine-1"
    rec.add(ids, [-0.5] * len(ids), [], 0)
    rec.finish_reason = finish
    return rec


def _pipeline(rec: GenerationRecord, ctl: Aborts, stop: list[str], parser: Any, one: bool):
    template = GenerationRequest(input_ids=[], max_new_tokens=0, stop_token_ids=[EOS])
    return TextPipeline(
        TOK, ctl, rec, template, Sampling(stop=stop), parser, one_call=one, keep=True
    )  # type: ignore[arg-type]


def _streamed(
    ids: list[int], finish: str, cuts: list[int], stop: list[str], parser: Any, one: bool
):
    """The pieces of `ids` fed as engine steps split at `cuts`, and the answer they make."""
    rec = GenerationRecord("r", [1, 2], 1000)
    rec.engine_rid = "engine-1"
    ctl = Aborts()
    pipe = _pipeline(rec, ctl, stop, parser, one)
    bounds = [0, *cuts, len(ids)]
    pieces = []
    for a, b in itertools.pairwise(bounds):
        last = b == len(ids)
        chunk = ids[a:b]
        rec.add(chunk, [-0.5] * len(chunk), [], 0)
        if last:
            rec.finish_reason = finish
        piece = pipe.feed(Step(chunk, [-0.5] * len(chunk), [], finish if last else None))
        pieces.append(piece)
        if piece.finish_reason is not None:
            break
    return pieces, pipe.answer(), ctl


def _whole(ids: list[int], finish: str, stop: list[str], parser: Any, one: bool):
    ctl = Aborts()
    return _pipeline(_record(ids, finish), ctl, stop, parser, one).whole(), ctl


OUTPUTS = [
    # (text, finish, stop strings, tools, parallel tool calls)
    ("Hello there, how are you today?", "stop", [], None, True),
    ("Hello there, how are you today?", "length", ["are"], None, True),
    ("no stop string in here at all", "length", ["xyz"], None, True),
    (f"Let me look. {CALL}", "stop", [], TOOLS, True),
    (f"{CALL}\n{CALL}", "stop", [], TOOLS, False),
    (f"{CALL}\n{CALL}", "stop", [], TOOLS, True),
    (f"cut inside a call {CALL[:20]}", "length", [], TOOLS, True),
    ("<think>weather first</think>It is sunny.", "stop", [], None, True),
]


@pytest.mark.parametrize("text, finish, stop, tools, parallel", OUTPUTS)
def test_a_whole_answer_is_what_its_streamed_pieces_add_up_to(
    text: str, finish: str, stop: list[str], tools: Any, parallel: bool
) -> None:
    parser = make_output_parser("hermes", "qwen3" if "<think>" in text else "", tools)
    ids = [*TOK.encode(text), EOS] if finish == "stop" else TOK.encode(text)
    whole, _ = _whole(ids, finish, stop, parser, not parallel)
    rnd = random.Random(7)
    for _ in range(12):
        cuts = sorted(rnd.sample(range(1, len(ids)), rnd.randint(0, min(6, len(ids) - 1))))
        pieces, answer, _ = _streamed(ids, finish, cuts, stop, parser, not parallel)
        # The same text, parsed parts and finish reason, whatever the split ...
        assert "".join(p.text for p in pieces) == whole.text == answer.text
        assert (answer.content, answer.reasoning) == (whole.content, whole.reasoning)
        assert [(c.name, c.arguments) for c in answer.tool_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ]
        assert (answer.finish, answer.text_finish) == (whole.finish, whole.text_finish)
        assert answer.call_counts == whole.call_counts
        assert pieces[-1].finish_reason == whole.finish
        # ... and the streamed events are what the client's deltas are made of.
        if parser is not None:
            sent = [d for p in pieces for d in delta_dicts(p.events or [])]
            assert "".join(d.get("content", "") for d in sent) == (whole.content or "")


def test_the_rules_of_a_finish() -> None:
    parser = make_output_parser("hermes", "", TOOLS)
    # A stop string ends the text and makes the finish "stop", in a whole answer too.
    whole, ctl = _whole(TOK.encode("one two three four"), "length", ["three"], None, False)
    assert (whole.text, whole.finish) == ("one two ", "stop") and ctl.aborted == []
    # "stop" with a tool call read is "tool_calls"; the schema check sees the text's "stop".
    whole, _ = _whole([*TOK.encode(CALL), EOS], "stop", [], parser, False)
    assert (whole.finish, whole.text_finish, whole.content) == ("tool_calls", "stop", None)
    assert whole.call_counts == (1, 1)
    # A call cut by max_tokens is no call: the finish stays "length".
    whole, _ = _whole(TOK.encode(CALL[:30]), "length", [], parser, False)
    assert whole.finish == "length" and whole.tool_calls == []
    # `parallel_tool_calls: false` keeps the first call; both are counted as made and read.
    whole, _ = _whole([*TOK.encode(f"{CALL}\n{CALL}"), EOS], "stop", [], parser, True)
    assert len(whole.tool_calls) == 1 and whole.call_counts == (2, 2)


def test_a_stop_string_mid_stream_aborts_the_engine_request_once() -> None:
    ids = TOK.encode("alpha beta gamma delta epsilon")
    # One token per step, as an engine decodes them.
    pieces, answer, ctl = _streamed(ids, "length", list(range(1, len(ids))), ["gamma"], None, False)
    assert answer.text == "alpha beta " and answer.finish == "stop"
    assert pieces[-1].finish_reason == "stop" and pieces[-1].step.finish_reason is None
    assert ctl.aborted == ["engine-1"]


def test_building_the_core_edits_none_of_its_collaborators(tmp_path: Path) -> None:
    """The core takes what the server built as it is: the recorder keeps its own session
    prompts (none here), the template its tool-call parser, the config its fields."""
    prompts = PromptBuilder(TOK)
    recorder = Recorder(SessionBook(Store(tmp_path / "r.db"), proxy_id="p"))
    config = InferenceConfig(model="m", tool_call_parser="")
    handler = InferenceHandler(
        config,
        TOK,
        prompts,
        GenerationController(FakeEngineClient([])),  # type: ignore[arg-type]
        recorder=recorder,
    )
    assert recorder.prompts is None
    assert prompts.template.tool_parser == ""
    assert handler.config is config and config.tool_call_parser == ""


def test_the_template_chooses_its_tool_parser_only_when_asked() -> None:
    # The parrot's template writes <tool_call>: hermes, when the server leaves it the choice.
    assert PromptBuilder(TOK, tool_parser=None).template.tool_parser == "hermes"
    assert PromptBuilder(TOK).template.tool_parser == ""
    assert PromptBuilder(TOK, tool_parser="llama3").template.tool_parser == "llama3"


async def test_the_server_gives_the_recorder_and_the_prelude_one_session_prompts() -> None:
    h = await start(FakeEngineClient([]))
    try:
        handler = h.server.servicer.handler
        recorder = handler.commit.recorder
        assert recorder is not None and recorder.prompts is not None
        assert recorder.prompts is handler.prelude.session_prompts
        assert isinstance(recorder.prompts, SessionPrompts)
    finally:
        await h.close()
