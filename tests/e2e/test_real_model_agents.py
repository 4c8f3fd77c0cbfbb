"""Agent frameworks on a real instruct model: SmolLM2-135M-Instruct behind a real stack
(router, gateway, data proxy with the hermes tool-call parser, SGLang on the CPU).

- `openai-agents`' default Runner (its Responses model, `/v1/responses`) completes a tool
  loop: the first turn's `tool_choice="required"` is enforced by constrained decoding, the
  tool runs, the Runner resets the choice to auto (its default) and the model answers in
  text. With a session key, both turns are recorded on the session.
- A JSON-schema answer of the real model parses and validates.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from pydantic import BaseModel
from stack import ADMIN_KEY, start_stack

pytestmark = pytest.mark.engine
MODEL = "smol"


@pytest.fixture(scope="module")
def stack(smol_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp("real-model-agents"),
        smol_engine.url,
        smol_engine.model_path,
        model=MODEL,
        n_proxies=1,
        proxy_args=["--tool-call-parser", "hermes"],
    )
    yield s
    s.stop()


def _admin(stack) -> httpx.Client:
    return httpx.Client(
        base_url=stack.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=300
    )


def test_openai_agents_runner_completes_a_tool_loop_and_it_is_recorded(stack):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    with _admin(stack) as c:
        r = c.post("/rl/start_session", json={"task_id": "agents", "group_size": 1})
    assert r.status_code == 201, r.text
    [sess] = r.json()["sessions"]
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def go():
        client = openai.AsyncOpenAI(
            base_url=stack.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
        )
        agents.set_default_openai_client(client, use_for_tracing=False)
        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather.",
            model=MODEL,
            tools=[get_weather],
            model_settings=agents.ModelSettings(
                tool_choice="required", max_tokens=64, temperature=0
            ),
        )
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(go())
    assert calls  # the forced call ran, then (tool choice reset to auto) the model answered
    assert isinstance(result.final_output, str) and result.final_output.strip()
    with _admin(stack) as c:
        e = c.post(
            "/rl/export_trajectories",
            json={"session_ids": [sess["session_id"]], "style": "individual"},
        )
    assert e.status_code == 200, e.text
    rows = e.json()["rows"]
    assert len(rows) == len(calls) + 1  # each model call a recorded interaction
    assert all(sum(r["loss_mask"]) > 0 for r in rows)


class Capital(BaseModel):
    country: str
    capital: str


def test_real_model_json_schema_answer_validates(stack):
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, timeout=300)
    try:
        r = client.chat.completions.parse(
            model=MODEL,
            messages=[
                {"role": "user", "content": "What is the capital of France? Answer in JSON."}
            ],
            max_tokens=48,
            temperature=0,
            response_format=Capital,
        )
    finally:
        client.close()
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital), r.choices[0].message.content
    assert json.loads(r.choices[0].message.content or "")["capital"] == parsed.capital


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_is_recorded_in_the_tokens_the_model_writes(stack, smol_engine, choice):
    """A forced call's fixed text is the tokenizer's encoding of it (on SmolLM2 `<tool_call>`
    is 5 tokens, `<`, `tool`, `_`, `call`, `>`), not text a t=1 sampler spells in whatever
    tokens make it up (it wrote `<`, `t`, `oo`, `l`, ...: 55 tokens for a 34-token call)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smol_engine.model_path / "tokenizer.json"))
    with _admin(stack) as c:
        r = c.post("/rl/start_session", json={"task_id": "forced", "group_size": 1})
    assert r.status_code == 201, r.text
    [sess] = r.json()["sessions"]
    client = openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
    )
    try:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=1.0,
            max_tokens=64,
            n=4,
        )
    finally:
        client.close()
    for ch in out.choices:
        [call] = ch.message.tool_calls or []
        assert call.function.name == "get_weather" and ch.finish_reason == "tool_calls"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    with _admin(stack) as c:
        e = c.post(
            "/rl/export_trajectories",
            json={"session_ids": [sess["session_id"]], "style": "individual"},
        )
    assert e.status_code == 200, e.text
    rows = e.json()["rows"]
    assert len(rows) == 4
    head = tok.encode('<tool_call>\n{"name": "get_weather", "arguments":', add_special_tokens=False)
    tail = tok.encode("\n</tool_call>", add_special_tokens=False)
    assert head.tokens[:5] == ["<", "tool", "_", "call", ">"]
    for row in rows:
        out_ids = [i for i, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        while out_ids and not tok.decode(out_ids[-1:], skip_special_tokens=True):
            out_ids.pop()  # the stop token
        pieces = [tok.decode([i]) for i in out_ids]
        canonical = tok.encode(tok.decode(out_ids), add_special_tokens=False).ids
        print(f"forced call: {len(out_ids)} tokens, the tokenizer writes it in {len(canonical)}")
        assert out_ids[: len(head.ids)] == head.ids, pieces
        assert out_ids[-len(tail.ids) :] == tail.ids, pieces
        # The whole call is as long as the tokenizer writes it, give or take the seams and
        # the model's own choice of tokens for the arguments.
        assert len(out_ids) <= len(canonical) + 3, (pieces, len(canonical))
