"""Agent frameworks on a real instruct model: SmolLM2-135M-Instruct behind a real stack
(router, gateway, data proxy, SGLang on the CPU). The proxy is started without
--tool-call-parser: SmolLM2's chat template does not render `tools`, so the proxy writes them
into the prompt in hermes' format and parses hermes calls (areal_proxy/prompt/tool_prompt.py).

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
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def token_stack(smol_engine, tmp_path_factory):
    """A proxy that forces a tool call's fixed text as token ids (--forced-call-token-ids)."""
    s = start_stack(
        tmp_path_factory.mktemp("forced-token-ids"),
        smol_engine.url,
        smol_engine.model_path,
        model=MODEL,
        n_proxies=1,
        proxy_args=["--forced-call-token-ids"],
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
            # One call: allowed several, SmolLM2 at temperature 0 repeats the same call
            # until max_tokens (measured: 5 identical calls in 160 tokens).
            model_settings=agents.ModelSettings(
                tool_choice="required", max_tokens=64, temperature=0, parallel_tool_calls=False
            ),
        )
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    # The forced call runs; then, with tool choice reset to auto, the model either answers or,
    # seeing in its prompt the call it sampled (the default `concat` prompts keep it, where
    # SmolLM2's template would drop it), greedily calls again until max_turns: a 135M model's
    # choice, not the service's. Either way every call must be recorded as sampled.
    try:
        result = asyncio.run(go())
        answered = 1
        assert isinstance(result.final_output, str) and result.final_output.strip()
    except agents.exceptions.MaxTurnsExceeded:
        answered = 0
    assert calls
    with _admin(stack) as c:
        e = c.post(
            "/rl/export_trajectories",
            json={"session_ids": [sess["session_id"]], "style": "individual"},
        )
        chained = c.post("/rl/export_trajectories", json={"session_ids": [sess["session_id"]]})
    assert e.status_code == 200, e.text
    rows = e.json()["rows"]
    assert len(rows) == len(calls) + answered  # each model call a recorded interaction
    assert all(sum(r["loss_mask"]) > 0 for r in rows)
    # The default export: the whole run is one chain, each turn continuing the exact ids the
    # one before was given and sampled.
    assert chained.status_code == 200, chained.text
    [row] = chained.json()["rows"]
    assert row["interaction_ids"] == [r["interaction_id"] for r in rows]
    assert row["chain_reason"] == "root" and len(row["spans"]) == len(rows)
    # Every call the runner executed was one the proxy parsed.
    assert row["tool_calls"]["called"] >= row["tool_calls"]["parsed"] >= len(calls)


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
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_tools_reach_the_real_models_prompt(stack):
    """SmolLM2's template ignores `tools`; they used to vanish (equal prompt_tokens)."""
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, timeout=300)
    msgs: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    try:
        plain = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=1, temperature=0
        )
        tooled = client.chat.completions.create(
            model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=1, temperature=0
        )
    finally:
        client.close()
    assert plain.usage and tooled.usage
    assert tooled.usage.prompt_tokens > plain.usage.prompt_tokens + 30


def test_required_tool_choice_ends_after_its_calls_on_the_real_model(stack):
    """Before the fix: allowed parallel calls, SmolLM2 at temperature 0 wrote the same call 3 times
    under `required`, then hit max_tokens (with `<tool_` left in content). Now at most one call
    per tool offered: one tool, one call, then the turn ends."""
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, timeout=300)
    try:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=96,
            temperature=0,
        )
    finally:
        client.close()
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"], choice.message  # type: ignore[union-attr]
    assert not choice.message.content


def test_langchain_bind_tools_calls_a_tool_on_the_real_model(stack):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=stack.gateway_url + "/v1",
        api_key=ADMIN_KEY,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=48,  # type: ignore[call-arg]
        max_retries=0,
        timeout=300,
    )

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    msg = llm.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather in Paris?"
    )
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"], msg
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)


def _counting_client(stack) -> tuple[openai.OpenAI, list[str]]:
    sent: list[str] = []
    http = httpx.Client(timeout=300, event_hooks={"request": [lambda r: sent.append(str(r.url))]})
    # The SDK's default retries (2) stay on: a 400 must not be retried.
    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, http_client=http)
    return client, sent


def test_an_invalid_json_schema_is_a_400_naming_response_format(stack):
    client, sent = _counting_client(stack)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    try:
        for stream in (False, True):
            sent.clear()
            with pytest.raises(openai.BadRequestError) as info:
                r = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=8,
                    response_format=bad,  # type: ignore[arg-type]
                    stream=stream,
                )
                if stream:
                    list(r)  # type: ignore[arg-type]
            err = info.value.body if isinstance(info.value.body, dict) else {}  # the SDK unwraps it
            assert err.get("param") == "response_format", info.value
            assert "objekt" in err["message"] and "/project/" not in err["message"]
            assert len(sent) == 1  # not retried
    finally:
        client.close()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_prompt_over_the_engines_kv_cache_is_a_400_naming_the_limit(stack, endpoint):
    """The engine runs with --max-total-tokens 4096 (it takes prompts under 4090 tokens)
    under a model context of 8192: the proxy learned the engine's limit and refuses at once."""
    client, sent = _counting_client(stack)
    text = "hello " * 5000
    try:
        with pytest.raises(openai.BadRequestError) as info:
            if endpoint == "chat":
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4
                )
            else:
                client.completions.create(model=MODEL, prompt=text, max_tokens=4)
    finally:
        client.close()
    err = info.value.body if isinstance(info.value.body, dict) else {}  # the SDK unwraps it
    param = "messages" if endpoint == "chat" else "prompt"
    assert (err.get("param"), err.get("code")) == (param, "context_length_exceeded"), err
    assert "fewer than 4090 tokens" in err["message"] and "--max-total-tokens" in err["message"]
    assert len(sent) == 1


CITY_TOOL = {
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
def test_a_forced_call_is_recorded_in_the_tokens_the_model_writes(token_stack, smol_engine, choice):
    """Before the fix: forced as text, a t=1 sampler spelt `<tool_call>` as `<`,`t`,`oo`,`l`,...
    (55 tokens for a call the tokenizer writes in 34). Now the call's fixed text is the
    tokenizer's own ids (`<`,`tool`,`_`,`call`,`>`), the arguments are the model's sampled
    tokens, and the recording holds exactly what was sampled, with its logprobs."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smol_engine.model_path / "tokenizer.json"))
    with _admin(token_stack) as c:
        r = c.post("/rl/start_session", json={"task_id": "forced", "group_size": 1})
    assert r.status_code == 201, r.text
    [sess] = r.json()["sessions"]
    client = openai.OpenAI(
        base_url=token_stack.gateway_url + "/v1", api_key=sess["session_api_key"], max_retries=0
    )
    try:
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[CITY_TOOL],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=1.0,
            max_tokens=64,
            logprobs=True,
            n=3,
        )
    finally:
        client.close()
    for ch in out.choices:
        [call] = ch.message.tool_calls or []
        assert call.function.name == "get_weather", ch  # type: ignore[union-attr]
        assert ch.finish_reason == "tool_calls", ch
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")  # type: ignore[union-attr]
    with _admin(token_stack) as c:
        e = c.post(
            "/rl/export_trajectories",
            json={"session_ids": [sess["session_id"]], "style": "individual"},
        )
    assert e.status_code == 200, e.text
    rows = e.json()["rows"]
    assert len(rows) == 3
    head = tok.encode('<tool_call>\n{"name": "get_weather", "arguments":', add_special_tokens=False)
    tail = tok.encode("\n</tool_call>", add_special_tokens=False).ids
    assert head.tokens[:5] == ["<", "tool", "_", "call", ">"]
    sampled = [[t.logprob for t in (ch.logprobs.content or [])] for ch in out.choices]
    assert all(len(s) > 20 for s in sampled), sampled
    recorded = []
    for row in rows:
        a = row["loss_mask"].index(1)
        ids, lps = row["input_ids"][a:], row["logprobs"][a:]
        assert all(row["loss_mask"][a:]), "every output token is the model's, sampled"
        recorded.append(lps)
        body = ids[:-1] if tok.id_to_token(ids[-1]) == "<|im_end|>" else ids
        pieces = [tok.id_to_token(i) for i in body]
        canonical = tok.encode(tok.decode(body), add_special_tokens=False).ids
        print(f"forced call: {len(body)} tokens, the tokenizer writes it in {len(canonical)}")
        print(pieces, [round(x, 3) for x in lps[:6]])
        assert body[: len(head.ids)] == head.ids, pieces
        assert body[-len(tail) :] == tail, pieces
        # Between them, the model's own tokens: the arguments with their seams (` `, `}`),
        # however it spelt them (the tokenizer may merge a seam with them: ` {"`, `"}}`).
        middle = tok.decode(body[len(head.ids) : -len(tail)])
        assert middle.startswith(" ") and middle.endswith("}"), pieces
        assert json.loads(middle[1:-1])["city"] in ("Paris", "Rome", "Oslo"), pieces
    # What was sampled is what is recorded: each answer's logprobs start a recorded row's.
    for s in sampled:
        assert any(r[: len(s)] == pytest.approx(s, abs=1e-6) for r in recorded), (s, recorded)
