"""The Responses API on the inference gateway through real processes (router, gateway, proxy)
in front of the real SGLang engine on the CPU, with the official `openai` SDK (sync, async,
stream) and `openai-agents`' default Runner (its Responses model).

A Responses call is a chat completion underneath (the gateway translates), so with a session
key it is recorded on the session like a chat: the exported tokens are the ones the response
carried. A tool loop needs a model that calls tools on cue, which the tiny models do not:
packages/areal-gateway/tests/test_responses.py runs that loop (the same Runner) against a
scripted proxy.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from stack import ADMIN_KEY, start_stack
from testpaths import PARROT
from tokenizers import Tokenizer

pytestmark = pytest.mark.engine
MODEL = "tiny-parrot"


@pytest.fixture(scope="module")
def stack(sglang_engine, tmp_path_factory):
    s = start_stack(tmp_path_factory.mktemp("responses"), sglang_engine.url, PARROT, n_proxies=1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(PARROT / "tokenizer.json"))


def _admin(stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120
    )


def _session(stack) -> dict:
    with _admin(stack) as c:
        r = c.post("/rl/start_session", json={"task_id": "responses", "group_size": 1})
    assert r.status_code == 201, r.text
    [sess] = r.json()["sessions"]
    return sess


def _export(stack, session_id: str) -> list[dict]:
    with _admin(stack) as c:
        r = c.post(
            "/rl/export_trajectories", json={"session_ids": [session_id], "style": "individual"}
        )
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["count"] == len(doc["rows"])
    return doc["rows"]


def _sdk(stack, key: str = ADMIN_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0)


def test_sync_async_and_stream_with_the_official_sdk(stack):
    client = _sdk(stack)
    r = client.responses.create(
        model=MODEL,
        input="Hello there",
        instructions="Repeat.",
        max_output_tokens=4,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and isinstance(r.output_text, str)
    assert r.usage is not None and 1 <= r.usage.output_tokens <= 4
    assert r.usage.input_tokens > 0

    async def go():
        aclient = openai.AsyncOpenAI(
            base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, max_retries=0
        )
        try:
            return await aclient.responses.create(
                model=MODEL,
                input="Hello there",
                instructions="Repeat.",
                max_output_tokens=4,
                temperature=0,
            )
        finally:
            await aclient.close()

    a = asyncio.run(go())
    assert a.output_text == r.output_text  # greedy: the same answer
    with client.responses.create(
        model=MODEL,
        input="Hello there",
        instructions="Repeat.",
        max_output_tokens=4,
        temperature=0,
        stream=True,
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_session_key_records_responses_like_chats_and_chains(stack, tok):
    sess = _session(stack)
    client = _sdk(stack, sess["session_api_key"])
    first = client.responses.create(
        model=MODEL, input="What is 2 + 3?", max_output_tokens=3, temperature=0
    )
    with client.responses.create(
        model=MODEL,
        input="and then?",
        previous_response_id=first.id,
        max_output_tokens=3,
        temperature=0,
        stream=True,
    ) as stream:
        second = [e for e in stream][-1].response  # type: ignore[union-attr]
    assert second.previous_response_id == first.id
    rows = _export(stack, sess["session_id"])
    assert len(rows) == 2
    for row, resp in zip(rows, (first, second), strict=True):
        # The recorded interaction is the response: its id, its tokens, their logprobs.
        assert row["interaction_id"] == "chatcmpl-" + resp.id.removeprefix("resp_")
        out = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert resp.usage is not None and len(out) == resp.usage.output_tokens
        assert tok.decode(out, skip_special_tokens=True) == resp.output_text
        n = len(row["input_ids"])
        assert len(row["logprobs"]) == len(row["versions"]) == n
        assert all(v >= 0 for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m)
        assert any(lp != 0 for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m)
    # The second prompt is the whole conversation: the first turn, its answer, the new input.
    prompt = [t for t, m in zip(rows[1]["input_ids"], rows[1]["loss_mask"], strict=True) if not m]
    text = tok.decode(prompt, skip_special_tokens=False)
    assert "What is 2 + 3?" in text and "and then?" in text
    assert first.output_text and first.output_text in text
    # A response the admin made is not this session's to continue.
    other = _sdk(stack).responses.create(model=MODEL, input="x", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=MODEL, input="y", previous_response_id=other.id, max_output_tokens=1
        )
    # Stored: the session reads back what it streamed, the admin does not see it; deleted.
    again = client.responses.retrieve(second.id)
    assert again.output_text == second.output_text and again.status == second.status
    with pytest.raises(openai.NotFoundError):
        _sdk(stack).responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(other.id)
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_unsupported_parameters_are_refused_before_generation(stack):
    client = _sdk(stack)
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL, input="x", background=True)
    assert ei.value.body["param"] == "background"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=MODEL, input="x", include=["no.such.include"])
    assert ei.value.code == "unsupported_parameter"
    assert ei.value.body["param"] == "include[0]"  # type: ignore[index]


def test_a_hosted_tool_is_left_out_and_said(stack):
    """A hosted tool areal cannot run (Codex sends `web_search` on every request) is left
    out of the prompt, not refused: the answer comes, and its header names what was left."""
    client = _sdk(stack)
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="x", tools=[{"type": "web_search"}], max_output_tokens=2
    )
    assert raw.headers["x-areal-left-out"] == "tools[0]"
    assert raw.parse().status == "incomplete"  # the parrot ran to max_output_tokens


def test_openai_agents_default_runner(stack, tok):
    """The Runner's default model calls `/v1/responses` with its own field set, which the
    gateway takes and records. The parrot never stops on its own (greedy decoding repeats
    the prompt's last token), so every answer ends at `max_output_tokens`: an `incomplete`
    response, which the Runner reports as the error it is. Its completed tool loop runs on a
    scripted proxy (packages/areal-gateway/tests/test_responses.py)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    sess = _session(stack)

    async def go():
        client = openai.AsyncOpenAI(
            base_url=stack.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
        )
        agents.set_default_openai_client(client, use_for_tracing=False)
        agent = agents.Agent(
            name="parrot",
            instructions="Repeat.",
            model=MODEL,
            model_settings=agents.ModelSettings(max_tokens=4, temperature=0),
        )
        try:
            return await agents.Runner.run(agent, "Hello there")
        finally:
            await client.close()

    with pytest.raises(agents.exceptions.ModelBehaviorError, match="max_output_tokens"):
        asyncio.run(go())
    [row] = _export(stack, sess["session_id"])
    assert sum(row["loss_mask"]) == 4
    prompt = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m]
    text = tok.decode(prompt, skip_special_tokens=False)
    assert "Repeat." in text and "Hello there" in text  # instructions first, then the input
    assert text.index("Repeat.") < text.index("Hello there")
