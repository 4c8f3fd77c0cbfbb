"""`concat` prompts across template families: a turn continues the exact ids of the turn it
extends (its prompt + the answer the model sampled), then exactly what the template writes
after that answer's turn ends (prompt/boundary.py), whatever the template would write for
the answer itself.

The templates are minimal ones of our own in the shape of each family (ChatML / Qwen with
hermes tool calls, Qwen3's reasoning that leaves the history, Llama-3 headers, SmolLM2's,
which writes no tool calls at all), over the bundled tiny-parrot tokenizer (and tiny-random,
its twin), with the family's special tokens added where it has others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from proxy_fakes import PARROT
from tokenizers import AddedToken, Tokenizer

from areal_proxy.common.records import Interaction
from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.prompt.boundary import Specials, TurnEnd
from areal_proxy.prompt.chat_template import PromptBuilder
from areal_proxy.prompt.incremental import Built, Previous, SessionPrompts
from areal_proxy.prompt.state import PromptState

RANDOM = PARROT.parent / "tiny-random"

# ChatML with hermes tool calls (Qwen2.5's shape): the tools in the system turn, a call as
# <tool_call> JSON (arguments written as sent, or as JSON when an object), tool results
# grouped in one user turn.
CHATML = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}"
    "{%- set a = c.function.arguments %}"
    "{{- ('\\n' if (m.content or not loop.first) else '') + '<tool_call>\\n{\"name\": \"' "
    '+ c.function.name + \'", "arguments": \' + (a if a is string else a | tojson) '
    "+ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's shape: an answer after the last user message shows its reasoning (the last
# message always, with an empty block), an earlier one only its text; so the rendering of
# the history changes once a new user message comes.
QWEN3 = CHATML.replace(
    "{{- '<|im_start|>assistant\\n' + (m.content or '') }}",
    "{%- if loop.index0 > ns.last_query and (loop.last or m.reasoning_content) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (m.reasoning_content or '') "
    "+ '\\n</think>\\n\\n' + (m.content or '') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}{%- endif %}",
).replace(
    "{%- for m in messages %}",
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}",
    1,
)

# Llama-3's shape: headers, <|eot_id|> after every message and nothing between messages, a
# call as {"name", "parameters"} JSON, a tool's result as an `ipython` message.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = '' %}"
    "{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    '{%- if tools %}{{- \'Call a function as {"name": name, "parameters": arguments}.\\n\\n\' }}'
    "{%- for t in tools %}{{- (t | tojson) + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "{%- set f = m.tool_calls[0].function %}"
    '{{- \'<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "\' + f.name '
    '+ \'", "parameters": \' + (f.arguments if f.arguments is string else f.arguments | tojson) '
    "+ '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content or '') | trim "
    "+ '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
]

# SmolLM2's shape: every message its role and content, no tools and no tool calls (the
# proxy writes the tools into the system message and the loop in words: tool_prompt.py).
SMOLLM2 = (
    "{%- for m in messages %}"
    "{%- if loop.first and m.role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


@dataclass
class Family:
    name: str
    template: str
    # Special tokens the family has beyond ChatML's, the end-of-turn token, and eos ids.
    specials: list[str]
    eos: str
    bos: str | None
    # How the model writes a call to bash with this command.
    call: str
    # What the template writes after an answer's end-of-turn token and before the next
    # message's text, for a tool's result and for a user message, and its generation prompt.
    after_tool: str
    after_user: str
    parser: str = ""
    # Other tokens the family adds as plain (non-special) added tokens.
    plain: tuple[str, ...] = ()


FAMILIES = [
    Family(
        "chatml",
        CHATML,
        [],
        "<|im_end|>",
        None,
        '<tool_call>\n{"name": "bash", "arguments": {"command": "%s"}}\n</tool_call>',
        "\n<|im_start|>user\n<tool_response>\n%s\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        "\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n",
    ),
    Family(
        "qwen3",
        QWEN3,
        [],
        "<|im_end|>",
        None,
        '<think>\nI list.\n</think>\n\n<tool_call>\n{"name": "bash", "arguments": '
        '{"command": "%s"}}\n</tool_call>',
        "\n<|im_start|>user\n<tool_response>\n%s\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        "\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n",
        plain=("<think>", "</think>", "<tool_call>", "</tool_call>"),
    ),
    Family(
        "llama3",
        LLAMA3,
        LLAMA3_SPECIALS,
        "<|eot_id|>",
        "<|begin_of_text|>",
        '{"name": "bash", "parameters": {"command": "%s"}}',
        "<|start_header_id|>ipython<|end_header_id|>\n\n%s<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|start_header_id|>user<|end_header_id|>\n\n%s<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    Family(
        "smollm2",
        SMOLLM2,
        [],
        "<|im_end|>",
        None,
        '<tool_call>\n{"name": "bash", "arguments": {"command": "%s"}}\n</tool_call>',
        "\n<|im_start|>user\nThe tool bash answered: %s<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n",
        parser="hermes",
    ),
]


def _model_dir(tmp: Path, base: Path, fam: Family) -> Path:
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    if fam.specials:
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in fam.specials]
        )
    if fam.plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.plain])
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    eos_ids = [tok.token_to_id(fam.eos)]
    if fam.name == "llama3":
        eos_ids += [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eom_id|>")]
    cfg: dict[str, Any] = {"chat_template": fam.template, "eos_token": fam.eos}
    if fam.bos:
        cfg["bos_token"] = fam.bos
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return tmp


@dataclass
class Setup:
    fam: Family
    tok: ModelTokenizer
    sp: SessionPrompts

    @property
    def end_id(self) -> int:
        return self.tok.tokenizer.token_to_id(self.fam.eos)

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


@pytest.fixture(
    params=[(f, b) for f in FAMILIES for b in ("parrot", "random")],
    ids=lambda p: f"{p[0].name}-{p[1]}",
)
def setup(request, tmp_path) -> Setup:
    fam, base = request.param
    path = _model_dir(tmp_path / fam.name, PARROT if base == "parrot" else RANDOM, fam)
    tok = ModelTokenizer.from_dir(path)
    builder = PromptBuilder(tok, template_type="concat")
    builder.template.tool_parser = fam.parser
    return Setup(fam, tok, SessionPrompts(builder, tok))


def _answered(built: Built, output: list[int], msgs: list[dict], echo: dict) -> Interaction:
    return Interaction("i", "s", 0, msgs, echo, built.ids, output, [0.0] * len(output), [], "stop")


def _call_echo(command: str, *, compact: bool) -> dict[str, Any]:
    """The answer as a client sends it back: the proxy's tool call, its arguments compact
    (as JavaScript harnesses re-serialize them) or as the proxy wrote them."""
    args = {"command": command}
    text = json.dumps(args, separators=(",", ":")) if compact else json.dumps(args)
    call = {"id": "call_a1", "type": "function", "function": {"name": "bash", "arguments": text}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _both(s: Setup, msgs, prev: Previous) -> tuple[Built, Built]:
    """The turn built from the cached state, and again as after a restart (no state)."""
    cached = s.sp.build(msgs, TOOLS, None, prev)
    cold = s.sp.build(
        msgs, TOOLS, None, Previous(parent=prev.parent, covered=prev.covered, reason="not_cached")
    )
    return cached, cold


def test_each_family_has_its_end_of_turn_token(setup):
    assert setup.sp.turn_end is not None
    assert setup.sp.turn_end.token == setup.fam.eos
    assert setup.sp.turn_end.token_id == setup.end_id


@pytest.mark.parametrize("compact", [False, True])
def test_a_tool_call_then_its_result_continues_the_sampled_ids(setup, compact):
    s = setup
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You run commands."},
        {"role": "user", "content": "What is here?"},
    ]
    first = s.sp.build(msgs, TOOLS, None, Previous())
    assert first.path == "full" and first.ids == s.tok.encode(s.sp.builder.render(msgs, TOOLS))
    # The model's call, as it sampled it, ended by its end-of-turn token.
    output = [*s.tok.encode(s.fam.call % "ls -la"), s.end_id]
    echo = _call_echo("ls -la", compact=compact)
    if s.fam.name == "qwen3":
        echo["reasoning_content"] = "I list."  # a client that sends the reasoning back
    parent = _answered(first, output, msgs, echo)
    state = s.sp.after_answer(first.state, output)
    msgs = [*msgs, echo, {"role": "tool", "tool_call_id": "call_a1", "content": "a.txt b.txt"}]
    prev = Previous(parent=parent, covered=3, parent_state=state)
    cached, cold = _both(s, msgs, prev)
    sampled = first.ids + output
    for built in (cached, cold):
        assert built.ids[: len(sampled)] == sampled, "the sampled call stays, token for token"
        assert built.reused == len(sampled)
        assert s.text(built.ids[len(sampled) :]) == s.fam.after_tool % "a.txt b.txt"
    assert cached.path == "incremental" and cold.path == "full:not_cached"
    assert cached.ids == cold.ids
    assert cached.tokenized == len(cached.ids) - len(sampled)
    if s.fam.name == "smollm2":
        # Its template writes no tool call: only the sampled ids keep the model's call.
        assert "<|im_start|>assistant\n<|im_end|>" in s.sp.builder.render(msgs, TOOLS)
        assert (s.fam.call % "ls -la") + "<|im_end|>" in s.text(cached.ids)

    # The model answers in words; the user asks again: the chain goes on.
    output2 = [*s.tok.encode("Two files."), s.end_id]
    answer = {"role": "assistant", "content": "Two files."}
    parent2 = _answered(cached, output2, msgs, answer)
    state2 = s.sp.after_answer(cached.state, output2)
    msgs = [*msgs, answer, {"role": "user", "content": "Thanks"}]
    prev2 = Previous(parent=parent2, covered=len(msgs) - 1, parent_state=state2)
    cached2, cold2 = _both(s, msgs, prev2)
    sampled2 = cached.ids + output2
    assert cached2.ids[: len(sampled2)] == sampled2
    assert s.text(cached2.ids[len(sampled2) :]) == s.fam.after_user % "Thanks"
    assert cached2.ids == cold2.ids
    # Qwen3's template drops the reasoning of answers before the new user message: the
    # conversation before the answer renders differently, and the ids are still the
    # parent's (found by rendering the conversation up to the answer).
    expected = "full:render_changed" if s.fam.name == "qwen3" else "incremental"
    assert cached2.path == expected


def test_an_answer_cut_short_gets_the_templates_end_of_turn(setup):
    """Cut by max_tokens (or a stop string), the answer has no end-of-turn token: the
    template's follows the sampled ids, then what it writes after it."""
    s = setup
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Count."}]
    first = s.sp.build(msgs, None, None, Previous())
    output = s.tok.encode("one two thr")
    answer = {"role": "assistant", "content": "one two thr"}
    parent = _answered(first, output, msgs, answer)
    state = s.sp.after_answer(first.state, output)
    msgs = [*msgs, answer, {"role": "user", "content": "Go on"}]
    for prev in (
        Previous(parent=parent, covered=2, parent_state=state),
        Previous(parent=parent, covered=2, reason="not_cached"),
    ):
        built = s.sp.build(msgs, None, None, prev)
        sampled = first.ids + output
        assert built.ids[: len(sampled)] == sampled
        assert s.text(built.ids[len(sampled) :]) == s.fam.eos + s.fam.after_user % "Go on"


def test_text_answers_sampled_as_tokenized_give_the_whole_tokenization(setup):
    """Where the model's answers are the tokenizer's own ids for their text and come back
    as written, `concat` and a whole tokenization of the rendering agree: the boundary
    adds nothing and drops nothing."""
    s = setup
    if s.fam.name == "qwen3":
        pytest.skip("the template writes the last answer with a reasoning block")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    built, state, parent = None, None, None
    for i, (q, a) in enumerate([("hi", "Hello!"), ("and?", " spaced  out "), ("x", "y\nz")]):
        msgs = [*msgs, {"role": "user", "content": q}]
        prev = Previous() if parent is None else Previous(parent, len(msgs) - 1, state)
        built = s.sp.build(msgs, None, None, prev)
        assert built.ids == s.tok.encode(s.sp.builder.render(msgs)), i
        assert built.path == ("full" if i == 0 else "incremental")
        shown = a.strip() if s.fam.name == "llama3" else a  # Llama-3's template trims
        output = [*s.tok.encode(shown), s.end_id]
        answer = {"role": "assistant", "content": a}
        parent = _answered(built, output, msgs, answer)
        state = s.sp.after_answer(built.state, output)
        msgs = [*msgs, answer]


def test_turn_end_probe_needs_a_special_token_right_after_the_answer():
    specials = Specials([{"id": 5, "content": "<end>", "special": True}])
    assert TurnEnd.probe(lambda m: "".join(f"{x['content']}<end>" for x in m), specials) == (
        TurnEnd("<end>", 5)
    )
    assert TurnEnd.probe(lambda m: "".join(f"{x['content']}\n" for x in m), specials) is None

    def fails(m: list[dict[str, Any]]) -> str:
        raise ValueError("no")

    assert TurnEnd.probe(fails, specials) is None


def test_a_template_with_no_end_token_continues_by_text_or_starts_a_new_chain(tmp_path):
    """A template that writes no special token after an answer: the ids continue where the
    rendering goes on from their exact text, and otherwise the turn is a new chain that
    says why (`boundary_unknown`)."""
    plain = (
        "{%- for m in messages %}{{- m.role + ': ' + (m.content or '') + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
    )
    fam = Family("plain", plain, [], "<|im_end|>", None, "", "", "")
    tok = ModelTokenizer.from_dir(_model_dir(tmp_path, PARROT, fam))
    sp = SessionPrompts(PromptBuilder(tok, template_type="concat"), tok)
    assert sp.turn_end is None
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = sp.build(msgs, None, None, Previous())
    output = tok.encode("hello\n")
    answer = {"role": "assistant", "content": "hello"}
    parent = _answered(first, output, msgs, answer)
    msgs = [*msgs, answer, {"role": "user", "content": "more"}]
    built = sp.build(msgs, None, None, Previous(parent, 2, sp.after_answer(first.state, output)))
    assert built.ids[: len(first.ids) + len(output)] == first.ids + output
    assert built.path == "full:render_changed" and built.reused == len(first.ids) + len(output)
    other = {"role": "assistant", "content": "hello there"}
    parent = _answered(first, tok.encode("hi\n"), msgs[:1], other)
    msgs = [msgs[0], other, {"role": "user", "content": "more"}]
    built = sp.build(msgs, None, None, Previous(parent, 2, reason="not_cached"))
    assert built.path == "full:boundary_unknown" and built.reused == 0
    assert built.ids == tok.encode(sp.builder.render(msgs))


def test_a_state_keeps_the_rendering_and_the_answer_ids():
    tok = ModelTokenizer.from_dir(PARROT)
    sp = SessionPrompts(PromptBuilder(tok), tok)
    built = sp.build([{"role": "user", "content": "hi"}], None, None, Previous())
    assert isinstance(built.state, PromptState)
    assert built.state.text == sp.builder.render([{"role": "user", "content": "hi"}])
    after = sp.after_answer(built.state, [5, 6, 2])
    assert after is not None and after.answer == [5, 6, 2] and after.ids == built.ids


def test_another_end_token_of_the_model_stands_for_the_templates(tmp_path):
    """Llama-3 stops on <|eom_id|> too (its generation config's eos ids): an answer ended
    by it has ended its turn, and the template's <|eot_id|> is not added after it."""
    fam = next(f for f in FAMILIES if f.name == "llama3")
    tok = ModelTokenizer.from_dir(_model_dir(tmp_path, PARROT, fam))
    sp = SessionPrompts(PromptBuilder(tok), tok)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = sp.build(msgs, None, None, Previous())
    output = [*tok.encode("hello"), tok.tokenizer.token_to_id("<|eom_id|>")]
    answer = {"role": "assistant", "content": "hello"}
    parent = _answered(first, output, msgs, answer)
    msgs = [*msgs, answer, {"role": "user", "content": "more"}]
    for state in (sp.after_answer(first.state, output), None):
        built = sp.build(msgs, None, None, Previous(parent, 2, state))
        assert built.ids[: len(first.ids) + len(output)] == first.ids + output
        assert tok.decode(built.ids[len(first.ids) + len(output) :], skip_special_tokens=False) == (
            fam.after_user % "more"
        )
