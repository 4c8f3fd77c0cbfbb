"""An agent service linked to a real inference service (SGLang on the CPU, parrot model).

Each agent session gets an RL session on the inference gateway; ToolUsingAgent calls a tool,
then the LLM with that session's key, so the call is recorded. A reward sent to the agent
gateway reaches that interaction, and the export holds the agent's LLM call with the reward.
"""

from __future__ import annotations

import openai
import orjson
import pytest
from agent_stack import PARROT, AgentStack, e2e, start_agent_stack
from tokenizers import Tokenizer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def linked(sglang_engine, tmp_path_factory: pytest.TempPathFactory):
    inf = e2e.start_stack(
        tmp_path_factory.mktemp("inf"), sglang_engine.url, PARROT, model="tiny-parrot", n_proxies=1
    )
    try:
        st = start_agent_stack(
            tmp_path_factory.mktemp("agent-linked"),
            "examples.agents.tool_user.ToolUsingAgent",
            n_pairs=1,
            proxy_args=["--inf-gateway-url", inf.gateway_url, "--inf-model", "tiny-parrot"],
            proxy_env={"AREAL_PROXY_INF_ADMIN_API_KEY": e2e.ADMIN_KEY},
        )
    except BaseException:
        inf.stop()
        raise
    yield st, inf
    st.stop()
    inf.stop()


def _message_text(output: list[dict]) -> str:
    return "".join(
        p["text"] for item in output if item["type"] == "message" for p in item["content"]
    )


def test_agent_llm_call_is_recorded_rewarded_and_exported(
    linked: tuple[AgentStack, object],
) -> None:
    st, _ = linked
    tok = Tokenizer.from_file(str(PARROT / "tokenizer.json"))
    with st.client() as admin:
        r = admin.post("/v1/sessions")
        assert r.status_code == 201, r.text
        s = r.json()
    sid = s["session_id"]
    assert s["rl_session_id"]
    with st.client(s["session_api_key"]) as c:
        r = c.post(
            "/v1/responses",
            json={"input": "compute", "metadata": {"expression": "6*7", "max_tokens": 6}},
        )
        assert r.status_code == 200, r.text
        out = r.json()["output"]
        assert [i["type"] for i in out] == ["function_call", "function_call_output", "message"]
        assert out[0]["name"] == "calculator" and out[1]["output"] == "42"
        first_text = _message_text(out)
        assert first_text
        # a second turn, streamed with the SDK: also an LLM call on the same RL session
        client = openai.OpenAI(
            base_url=st.gateway_url + "/v1", api_key=s["session_api_key"], max_retries=0
        )
        with client.responses.create(
            model="agent",
            input="again",
            metadata={"expression": "1+2", "max_tokens": "4"},
            stream=True,
        ) as events:
            kinds = [ev.type for ev in events]
        assert "response.function_call_arguments.done" in kinds
        assert kinds[-1] == "response.completed"

        r = c.post(f"/v1/sessions/{sid}/reward", json={"reward": 1.0})
        assert r.status_code == 200, r.text
        rewarded = r.json()
        assert rewarded["reward"] == 1.0 and rewarded["interaction_id"]

        r = c.post(f"/v1/sessions/{sid}/export", json={"style": "individual", "discount": 1.0})
        assert r.status_code == 200, r.text
        rows = r.json()["rows"]
    assert len(rows) == 2, orjson.dumps(rows)[:500]
    assert all(row["agent_session_id"] == sid for row in rows)
    last = next(row for row in rows if row["interaction_id"] == rewarded["interaction_id"])
    assert last["reward"] == 1.0
    # the first turn's LLM call: its output tokens are what the agent streamed to the client
    first = next(row for row in rows if row is not last)
    out_ids = [t for t, m in zip(first["input_ids"], first["loss_mask"], strict=True) if m]
    assert 1 <= len(out_ids) <= 6
    assert first_text in tok.decode(out_ids, skip_special_tokens=False)
    prompt = tok.decode(first["input_ids"][: first["loss_mask"].index(1)])
    assert "compute (6*7 = 42)" in prompt

    # closing the agent session ends the linked RL session too
    with st.client() as admin:
        assert admin.delete(f"/v1/sessions/{sid}").status_code == 200
        assert admin.post(f"/v1/sessions/{sid}/export", json={}).status_code == 404
