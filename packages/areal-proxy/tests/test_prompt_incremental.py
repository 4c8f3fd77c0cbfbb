"""A session turn's prompt continued from its previous turn equals the full path's, bit for bit.

`hf`: the ids of a continued prompt equal tokenizing the whole rendering (checked on the
bundled byte-level BPE tokenizer and on a Metaspace one built here, over conversations with
special tokens, tool calls, non-ASCII text and odd whitespace in them). `concat`: the ids
are the previous turn's prompt + answer ids, then the new text's (with or without the
cached state alike); test_prompt_concat.py has the template families.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import orjson
import pytest
from proxy_fakes import PARROT
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from areal_proxy.common.records import Interaction
from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.prompt.chat_template import PromptBuilder, PromptTooLong
from areal_proxy.prompt.cuts import Cuts
from areal_proxy.prompt.incremental import Previous, SessionPrompts
from areal_proxy.prompt.state import CachedTurn, TurnCache

WORDS = [
    "alpha",
    " beta",
    "gamma\n",
    "  spaced  ",
    "\t",
    "ünïcödé",
    "漢字",
    "🙂",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start",
    "|>",
    "\n\n",
    "x",
    "123",
    '{"k": [1, 2]}',
]


def _text(rng: random.Random, n: int, words: list[str] = WORDS) -> str:
    return "".join(rng.choice(words) for _ in range(n))


# What a model writes: no special-token text (an answer decoded for the client drops it, so
# its echo would not match what was generated; that case is a fallback, tested apart).
ANSWER_WORDS = [w for w in WORDS if "<|" not in w and "|>" not in w]


def _tool_call(rng: random.Random, i: int) -> dict:
    args = json.dumps({"q": _text(rng, 3), "n": i})
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "search", "arguments": args},
    }


def _turns(rng: random.Random, n_turns: int, tools: bool) -> list[list[dict]]:
    """The message list of every turn of one conversation, each extending the last, with
    the assistant answers (some with tool calls and their tool results) echoed back."""
    msgs: list[dict] = [{"role": "system", "content": _text(rng, 5)}]
    out = []
    for i in range(n_turns):
        msgs.append({"role": "user", "content": _text(rng, rng.randint(1, 30))})
        out.append(list(msgs))
        if tools and rng.random() < 0.4:
            call = _tool_call(rng, i)
            msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": _text(rng, 8)})
            out.append(list(msgs))
        msgs.append({"role": "assistant", "content": _text(rng, rng.randint(0, 20))})
    return out


def _metaspace_dir(tmp: Path) -> Path:
    """A sentencepiece-style tokenizer (Metaspace, prepend only to the first piece, byte
    fallback) with ChatML special tokens, trained here on a little text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback(), decoders.Fuse()]
    )
    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=[f"<0x{b:02X}>" for b in range(256)],
    )
    rng = random.Random(7)
    # Every character the conversations and the template write, so nothing is unknown (an
    # unknown character decodes to "<unk>", and concat's text check then falls back).
    printable = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    tok.train_from_iterator([printable, *(_text(rng, 40) for _ in range(300))], trainer)
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    template = (PARROT / "chat_template.jinja").read_text()
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|im_end|>"})
    )
    return tmp


@pytest.fixture(params=["parrot", "metaspace"])
def tok(request, tmp_path) -> ModelTokenizer:
    path = PARROT if request.param == "parrot" else _metaspace_dir(tmp_path / "ms")
    return ModelTokenizer.from_dir(path)


def _full(builder: PromptBuilder, tok: ModelTokenizer, msgs, tools=None) -> list[int]:
    return tok.encode(builder.render(msgs, tools))


def _check_json(built) -> None:
    """The JSON kept for the engine request says exactly the ids."""
    if built.incremental:
        assert orjson.loads(built.ids_json) == built.ids
    state = built.state
    if state is not None and state.json:
        assert orjson.loads(b"[" + bytes(state.kept_json()) + b"]") == state.ids[: state.kept]


@pytest.mark.parametrize("seed", range(6))
def test_hf_continued_prompts_equal_whole_tokenization(tok, seed):
    rng = random.Random(seed)
    builder = PromptBuilder(tok, template_type="hf")
    sp = SessionPrompts(builder, tok)
    assert sp.cuts is not None
    tools = [{"type": "function", "function": {"name": "search"}}] if seed % 2 else None
    state = None
    paths = []
    for msgs in _turns(rng, 20, tools=True):
        built = sp.build(msgs, tools, None, Previous(parent_state=state))
        assert built.ids == _full(builder, tok, msgs, tools)
        _check_json(built)
        paths.append(built.incremental)
        state = built.state
    assert paths[0] is False and all(paths[1:]), "every turn after the first continues"


def test_hf_continued_prompt_tokenizes_only_what_is_new(tok):
    builder = PromptBuilder(tok, template_type="hf")
    sp = SessionPrompts(builder, tok)
    history = [{"role": "user", "content": "word " * 2000}]
    first = sp.build(history, None, None, Previous())
    history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    second = sp.build(history, None, None, Previous(parent_state=first.state))
    assert second.incremental and second.ids == _full(builder, tok, history)
    assert second.tokenized < 40 < len(first.ids)
    assert second.reused == first.state.cut_tokens[-1]


def test_hf_changed_history_falls_back_to_the_full_prompt(tok):
    builder = PromptBuilder(tok, template_type="hf")
    sp = SessionPrompts(builder, tok)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    first = sp.build(msgs, None, None, Previous())
    later = [
        {"role": "system", "content": "be verbose"},  # a new system prompt
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    built = sp.build(later, None, None, Previous(parent_state=first.state))
    assert not built.incremental and built.reason == "render_changed"
    assert built.path == "full:render_changed"
    assert built.ids == _full(builder, tok, later)
    # The same, seen from the lineage: no parent, only the session's latest state.
    built = sp.build(later, None, None, Previous(latest_state=first.state, reason="history_edited"))
    assert built.reason == "history_edited" and built.ids == _full(builder, tok, later)
    # Tools the template renders, added mid-session.
    tools = [{"type": "function", "function": {"name": "f"}}]
    msgs2 = [*msgs, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    built = sp.build(msgs2, tools, None, Previous(parent_state=first.state))
    assert built.reason == "render_changed" and built.ids == _full(builder, tok, msgs2, tools)


def test_hf_continued_prompt_is_checked_against_the_context(tok):
    builder = PromptBuilder(tok, template_type="hf")
    sp = SessionPrompts(builder, tok)
    msgs = [{"role": "user", "content": "hi"}]
    first = sp.build(msgs, None, None, Previous())
    msgs = [*msgs, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x" * 400}]
    with pytest.raises(PromptTooLong):
        sp.build(msgs, None, None, Previous(parent_state=first.state), limit=len(first.ids) + 20)


def _answered(ids: list[int], output: list[int], msgs: list[dict], answer: dict) -> Interaction:
    return Interaction("i", "s", 0, msgs, answer, ids, output, [0.0] * len(output), [], "stop")


@pytest.mark.parametrize("seed", range(4))
def test_concat_continued_prompts_are_the_sampled_ids_then_the_new_text(tok, seed):
    rng = random.Random(100 + seed)
    builder = PromptBuilder(tok, template_type="concat")
    sp = SessionPrompts(builder, tok)
    state = parent = None
    covered = 0
    msgs: list[dict] = [{"role": "system", "content": _text(rng, 4)}]
    for _ in range(15):
        user = {"role": "user", "content": _text(rng, rng.randint(1, 20))}
        msgs = [*msgs, user]
        prev = Previous(parent=parent, covered=covered, parent_state=state)
        built = sp.build(msgs, None, None, prev)
        _check_json(built)
        if parent is None:
            assert built.ids == _full(builder, tok, msgs)
        else:
            sampled = parent.prompt_ids + parent.output_ids
            assert built.ids[: len(sampled)] == sampled and built.incremental
            assert tok.decode(built.ids[len(sampled) :], skip_special_tokens=False) == (
                f"\n<|im_start|>user\n{user['content']}<|im_end|>\n<|im_start|>assistant\n"
            )
            # The same ids without the cached state (after a restart).
            cold = sp.build(msgs, None, None, Previous(parent=parent, covered=covered))
            assert cold.ids == built.ids and cold.path == "full:not_cached"
            if tok._byte_level:
                # Answers that are the tokenizer's own ids, echoed as written: nothing
                # differs from tokenizing the whole rendering.
                assert built.ids == _full(builder, tok, msgs)
        # The model's answer: tokens of some text, ended by the end-of-turn token.
        answer_text = _text(rng, rng.randint(1, 10), ANSWER_WORDS)
        output = [*tok.encode(answer_text), tok.eos_token_ids[0]]
        answer = {"role": "assistant", "content": tok.decode(output)}
        parent = _answered(built.ids, output, msgs, answer)
        state = sp.after_answer(built.state, output)
        assert state is not None
        assert state.answer == output and state.ids == built.ids
        assert orjson.loads(b"[" + bytes(state.kept_json()) + b"]") == state.ids
        msgs = [*msgs, answer]
        covered = len(msgs)


def test_concat_without_a_cached_state_continues_from_the_parent(tok):
    builder = PromptBuilder(tok, template_type="concat")
    sp = SessionPrompts(builder, tok)
    msgs = [{"role": "user", "content": "hi"}]
    first = sp.build(msgs, None, None, Previous())
    output = [*tok.encode("hello"), tok.eos_token_ids[0]]
    answer = {"role": "assistant", "content": "hello"}
    parent = _answered(first.ids, output, msgs, answer)
    msgs2 = [*msgs, answer, {"role": "user", "content": "more"}]
    built = sp.build(msgs2, None, None, Previous(parent=parent, covered=2, reason="not_cached"))
    assert not built.incremental and built.reason == "not_cached"
    assert built.ids[: len(first.ids) + len(output)] == first.ids + output
    assert built.reused == len(first.ids) + len(output)


def test_concat_keeps_the_ids_of_an_answer_echoed_differently(tok):
    """The client sends the answer back other than the model wrote it (here: its text with
    other whitespace): the sampled ids stay, and only the new messages are tokenized."""
    builder = PromptBuilder(tok, template_type="concat")
    sp = SessionPrompts(builder, tok)
    msgs = [{"role": "user", "content": "hi"}]
    first = sp.build(msgs, None, None, Previous())
    output = [*tok.encode("  hello  "), tok.eos_token_ids[0]]
    echo = {"role": "assistant", "content": "hello"}
    parent = _answered(first.ids, output, msgs, echo)
    state = sp.after_answer(first.state, output)
    msgs2 = [*msgs, echo, {"role": "user", "content": "more"}]
    built = sp.build(msgs2, None, None, Previous(parent, 2, state))
    assert built.incremental and built.ids[: len(first.ids) + len(output)] == first.ids + output
    assert tok.decode(built.ids[len(first.ids) + len(output) :], skip_special_tokens=False) == (
        "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )


def test_cuts_refuse_tokens_that_overlap_and_skip_lstrip_ones():
    def added(content, **flags):
        return {"id": len(content), "content": content, **flags}

    assert Cuts.of([added("<a>"), added("<a>b")]) is None  # one contains the other
    assert Cuts.of([added("<ab"), added("b>")]) is None  # one ends with what the other begins
    assert Cuts.of([added("abab")]) is None  # overlaps itself
    cuts = Cuts.of([added("<s>"), added("<mask>", lstrip=True), added("<n>", normalized=True)])
    assert cuts is not None and set(cuts.ids) == {"<s>"}
    assert cuts.matches("x<s>y<mask><s>") == [(1, 3), (11, 3)]


def test_turn_cache_is_bounded_and_keeps_the_latest_session():
    cache = TurnCache(max_bytes=3_000)

    def turn(i: int, body: int) -> CachedTurn:
        it = Interaction(f"i{i}", "s", i, [], {}, list(range(100)), [1], [0.0], [0], "stop")
        return CachedTurn(it, None, body_bytes=body)

    cache.put("a", turn(1, 500))
    cache.put("b", turn(2, 500))
    assert len(cache) == 1 and cache.evictions == 1, "a is evicted for b"
    assert cache.get("a", "i1") is None and cache.get("b", "i2") is not None
    assert cache.body_bytes("b") == 500
    for i in range(3, 10):
        cache.put("b", turn(i, 10))
    assert len(cache._sessions["b"].turns) == 3, "a few turns per session"
    cache.drop(["b"])
    assert cache.nbytes == 0 and cache.latest("b") is None
    off = TurnCache(max_bytes=0)
    off.put("a", turn(1, 1))
    assert off.latest("a") is None


def test_an_engine_request_with_its_ids_encoded_already_is_the_same_request():
    from areal_proxy.engine.base import GenerationRequest
    from areal_proxy.engine.sglang import _payload

    ids = [5, 1, 900, 2]
    req = GenerationRequest(input_ids=ids, max_new_tokens=4, rid="r-1", top_logprobs=2)
    encoded = GenerationRequest(
        input_ids=ids, max_new_tokens=4, rid="r-1", top_logprobs=2, input_ids_json=b"[5,1,900,2]"
    )
    for stream in (False, True):
        assert orjson.loads(_payload(encoded, stream)) == orjson.loads(_payload(req, stream))
