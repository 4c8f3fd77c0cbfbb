"""Long RL sessions through a real stack: what the suites of `test_long_sessions.py` (the
parrot) and `test_real_model_long_sessions.py` (SmolLM2) share.

A session's chat turns go through the official `openai` SDK against the gateway (whole and
streamed, logprobs on); each turn's prompt path is read from the proxy's Prometheus counters
(`areal_proxy_prompt_builds_total{path}`, `areal_proxy_prompt_fallbacks_total{reason}`)
before and after it, and the session's export (`individual` rows) is checked against the
reference: the whole conversation rendered by the model's chat template and tokenized whole
(`hf`), or the previous turn's exact ids continued by the decoding path (`concat`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from stack import ADMIN_KEY, Proc, Stack

from areal_proxy.common.tokenizer import ModelTokenizer
from areal_proxy.prompt.chat_template import PromptBuilder

FALLBACK_REASONS = (
    "new_conversation",
    "history_edited",
    "not_cached",
    "render_changed",
    "boundary_unknown",
    "tokenizer_unsupported",
)
BUILDS = "areal_proxy_prompt_builds_total"
FALLBACKS = "areal_proxy_prompt_fallbacks_total"
TOKENIZED = "areal_proxy_prompt_tokenized_tokens_total"
CACHE_BYTES = "areal_proxy_prompt_cache_bytes"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


# ---- the RL API --------------------------------------------------------------------------


def admin(stack: Stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=300
    )


def start_session(stack: Stack, task: str = "long") -> tuple[str, str]:
    """(session id, session key) of a new one-session group."""
    with admin(stack) as c:
        r = c.post("/rl/start_session", json={"task_id": task, "group_size": 1})
    assert r.status_code == 201, r.text
    [s] = r.json()["sessions"]
    return s["session_id"], s["session_api_key"]


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0, timeout=300
    )


def export_rows(stack: Stack, session_id: str, style: str = "individual") -> list[dict]:
    with admin(stack) as c:
        r = c.post("/rl/export_trajectories", json={"session_ids": [session_id], "style": style})
    assert r.status_code == 200, r.text
    return r.json()["rows"]


def split(row: dict) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, output ids, output logprobs) of an `individual` row (loss_mask 0 = prompt)."""
    mask = row["loss_mask"]
    a = mask.index(1) if 1 in mask else len(mask)
    assert all(mask[a:]), "one interaction: every token after the prompt is generated"
    return row["input_ids"][:a], row["input_ids"][a:], row["logprobs"][a:]


# ---- the proxy's prompt metrics ----------------------------------------------------------


def samples(proc: Proc, name: str) -> dict[str, float]:
    """A metric's samples on a component's metrics port, by their one label's value."""
    body = httpx.get(f"http://127.0.0.1:{proc.info['metrics_port']}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith(name + "{"):
            head, _, value = line.rpartition(" ")
            label = head[len(name) + 1 : -1]  # path="incremental"
            out[label.partition("=")[2].strip('"')] = float(value)
    return out


def prompt_counts(proc: Proc) -> dict[str, float]:
    """{"incremental", "full", <each fallback reason>}: the proxy's counters now."""
    return {**samples(proc, BUILDS), **samples(proc, FALLBACKS)}


def counted(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What changed between two `prompt_counts` (zeros left out)."""
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def path_of(before: dict[str, float], after: dict[str, float]) -> str:
    """The prompt path of the one turn between two readings: "incremental", "full" or
    "full:<reason>" (as the proxy records it on the interaction)."""
    d = counted(before, after)
    if d in ({"incremental": 1.0}, {"full": 1.0}):
        return next(iter(d))
    reasons = [r for r in FALLBACK_REASONS if d.get(r) == 1.0]
    if len(reasons) == 1 and d == {"full": 1.0, reasons[0]: 1.0}:
        return "full:" + reasons[0]
    return f"unexpected counter change {d}"


# ---- turns -------------------------------------------------------------------------------


@dataclass
class Answer:
    id: str
    content: str
    finish: str | None
    token_bytes: list[list[int]]
    logprobs: list[float]
    prompt_tokens: int | None
    completion_tokens: int | None


@dataclass
class Turn:
    messages: list[dict[str, Any]]
    answer: Answer
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    path: str = ""


def ask(
    client: openai.OpenAI,
    model: str,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int,
    stream: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> Answer:
    kw: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
    }
    if tools:
        kw["tools"] = tools
    if not stream:
        r = client.chat.completions.create(**kw)
        ch = r.choices[0]
        lp = ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
        return Answer(
            r.id,
            ch.message.content or "",
            ch.finish_reason,
            [list(e.bytes or []) for e in lp],
            [e.logprob for e in lp],
            r.usage.prompt_tokens if r.usage else None,
            r.usage.completion_tokens if r.usage else None,
        )
    rid, text, finish, token_bytes, lps = "", [], None, [], []
    prompt_tokens = completion_tokens = None
    for chunk in client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        rid = rid or chunk.id
        if chunk.usage is not None:
            prompt_tokens, completion_tokens = (
                chunk.usage.prompt_tokens,
                chunk.usage.completion_tokens,
            )
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
            if ch.logprobs and ch.logprobs.content:
                token_bytes += [list(e.bytes or []) for e in ch.logprobs.content]
                lps += [e.logprob for e in ch.logprobs.content]
    return Answer(rid, "".join(text), finish, token_bytes, lps, prompt_tokens, completion_tokens)


def user(i: int) -> dict[str, Any]:
    """The user's i-th message: varied lengths, some non-ASCII text."""
    extra = " and more" * (i % 3)
    tail = " — café 🙂" if i % 5 == 1 else ""
    return {"role": "user", "content": f"Q{i}: next?{extra}{tail}"}


def tool_exchange(i: int) -> list[dict[str, Any]]:
    """An assistant message that only calls a tool (content null, as OpenAI clients send
    it) and the tool's result, as a harness writes them itself."""
    call_id = f"call_{i:03d}"
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "lookup", "arguments": json.dumps({"q": i})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": f"found {i}"},
    ]


def echoed(answer: Answer) -> dict[str, Any]:
    return {"role": "assistant", "content": answer.content}


@dataclass
class Session:
    """One RL session driven turn by turn; each turn's prompt path read from the metrics."""

    stack: Stack
    model: str
    max_tokens: int
    proxy: Proc
    session_id: str = ""
    key: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.session_id, self.key = start_session(self.stack)
        self.client = sdk(self.stack, self.key)

    def send(
        self,
        messages: list[dict[str, Any]],
        *,
        stream: bool = False,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
    ) -> Turn:
        """One turn with exactly these messages (the conversation is not changed)."""
        before = prompt_counts(self.proxy)
        answer = ask(
            self.client,
            self.model,
            messages,
            max_tokens=max_tokens or self.max_tokens,
            stream=stream,
            tools=tools,
        )
        turn = Turn(
            list(messages), answer, tools, stream, path_of(before, prompt_counts(self.proxy))
        )
        self.turns.append(turn)
        return turn

    def turn(
        self,
        i: int,
        *,
        stream: bool = False,
        tool: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> Turn:
        """The conversation's next turn: (a tool call and its result,) the i-th user message;
        the answer is echoed back into the conversation."""
        if tool:
            self.messages += tool_exchange(i)
        self.messages.append(user(i))
        t = self.send(self.messages, stream=stream, tools=tools)
        self.messages.append(echoed(t.answer))
        return t

    def run(
        self, first: int, n: int, *, stream_every: int = 4, tool_every: int = 3, **kw: Any
    ) -> list[Turn]:
        """n turns, i = first .. first + n - 1: every `stream_every`-th streamed, every
        `tool_every`-th carrying a tool call and its result."""
        return [
            self.turn(
                i, stream=i % stream_every == stream_every - 1, tool=i % tool_every == 2, **kw
            )
            for i in range(first, first + n)
        ]


# ---- the references ----------------------------------------------------------------------


class Reference:
    """The full path: the model's chat template rendered whole, tokenized whole."""

    def __init__(self, model_dir: Path) -> None:
        self.tok = ModelTokenizer.from_dir(model_dir)
        self.hf = PromptBuilder(self.tok, template_type="hf")

    def full(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None):
        return self.tok.encode(self.hf.render(messages, tools))

    def concat_ids(
        self,
        messages: list[dict[str, Any]],
        previous_ids: list[int] | None,
        previous_messages: int,
    ) -> list[int]:
        """`concat`: the previous turn's prompt + output ids, then what the rendering writes
        after the answer's <|im_end|> (ChatML: the parrot's template writes the conversation
        up to the answer as a prefix of the whole), that token first where the answer was
        cut before it."""
        rendered = self.hf.render(messages)
        if previous_ids is None:
            return self.tok.encode(rendered)
        head = self.hf.template.render(messages[:previous_messages], add_generation_prompt=False)
        end = "<|im_end|>"
        assert rendered.startswith(head) and head.endswith(end + "\n")
        ended = previous_ids[-1] in self.tok.eos_token_ids
        text = rendered[len(head) - (1 if ended else len(end) + 1) :]
        return previous_ids + self.tok.encode(end + text)[1:]


def first_diff(got: list[int], want: list[int], tok: ModelTokenizer) -> str:
    """Where two id lists part, with the text around it (for an assertion's message)."""
    k = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
        min(len(got), len(want)),
    )
    lo = max(0, k - 8)
    return (
        f"lengths {len(got)} vs {len(want)}, first difference at {k}: "
        f"got {got[lo : k + 8]} = {tok.decode(got[lo : k + 8], skip_special_tokens=False)!r}, "
        f"want {want[lo : k + 8]} = {tok.decode(want[lo : k + 8], skip_special_tokens=False)!r}"
    )


def by_interaction(rows: list[dict]) -> dict[str, dict]:
    return {r["interaction_id"]: r for r in rows}


def check_output(ref: Reference, row: dict, answer: Answer) -> None:
    """The exported output ids and logprobs are what the SDK got."""
    prompt, out, lps = split(row)
    tok = ref.tok
    eos = set(tok.eos_token_ids)
    assert [list(tok.token_bytes(t)) for t in out] == answer.token_bytes, (out, answer)
    assert lps == answer.logprobs, (lps, answer.logprobs)
    body = out[:-1] if out and out[-1] in eos else out
    assert tok.decode(body, skip_special_tokens=True) == answer.content, (out, answer.content)
    assert answer.completion_tokens == len(out), (answer.completion_tokens, len(out))
    assert answer.prompt_tokens == len(prompt), (answer.prompt_tokens, len(prompt))
    assert all(v >= 0 for v in row["versions"][len(prompt) :])


def check_hf(ref: Reference, rows: list[dict], turns: list[Turn]) -> None:
    """Every turn is exported; its prompt ids are its messages' full tokenization, its output
    what the SDK got."""
    rows_by_id = by_interaction(rows)
    assert len(rows) == len(turns), (len(rows), len(turns))
    for i, t in enumerate(turns):
        row = rows_by_id[t.answer.id]
        prompt, _, _ = split(row)
        want = ref.full(t.messages, t.tools)
        assert prompt == want, f"turn {i} ({t.path}, {len(t.messages)} messages): " + first_diff(
            prompt, want, ref.tok
        )
        check_output(ref, row, t.answer)


def check_concat(ref: Reference, rows: list[dict], turns: list[Turn]) -> None:
    """Every turn's prompt continues the previous turn's exact prompt + output ids, then the
    template's text after the answer (`Reference.concat_ids`); outputs are what the SDK got."""
    assert len(rows) == len(turns)
    rows_by_id = by_interaction(rows)
    previous: list[int] | None = None
    covered = 0
    for i, t in enumerate(turns):
        row = rows_by_id[t.answer.id]
        prompt, out, _ = split(row)
        if previous is not None:
            assert prompt[: len(previous)] == previous, f"turn {i}: " + first_diff(
                prompt[: len(previous)], previous, ref.tok
            )
        want = ref.concat_ids(t.messages, previous, covered)
        assert prompt == want, f"turn {i}: " + first_diff(prompt, want, ref.tok)
        check_output(ref, row, t.answer)
        previous, covered = prompt + out, len(t.messages) + 1
