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
