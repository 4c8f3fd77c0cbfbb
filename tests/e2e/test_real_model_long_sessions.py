"""Long RL sessions on SmolLM2-135M-Instruct (vocab 49,152, its real ChatML template, which
renders no tools) behind real binaries: gateway, router, data proxy, SGLang on the CPU (the
real-model stage's one session engine).

30 turns of one session, whole and streamed, with tool calls and results the client writes
into the conversation (the template renders a tool-call message's null content as empty):
- `hf`: every exported prompt is its messages' full tokenization; 29 incremental builds.
- `concat`: every prompt continues the previous turn's exact prompt + output ids and equals
  the decoding path's; 29 incremental builds.
Every exported output is what the SDK got (token bytes, logprobs, text, usage).
"""

from __future__ import annotations

import pytest
from long_sessions import (
    Reference,
    Session,
    check_concat,
    check_hf,
    counted,
    export_rows,
    prompt_counts,
)
from stack import start_stack

pytestmark = pytest.mark.engine
MODEL = "smol"
MAX_TOKENS = 4
TURNS = 30


@pytest.fixture(scope="module")
def ref(smol_engine):
    return Reference(smol_engine.model_path)


@pytest.fixture(scope="module", params=["hf", "concat"])
def stack(request, smol_engine, tmp_path_factory):
    s = start_stack(
        tmp_path_factory.mktemp(f"real-model-long-{request.param}"),
        smol_engine.url,
        smol_engine.model_path,
        model=MODEL,
        n_proxies=1,
        proxy_args=["--chat-template-type", request.param],
    )
    yield request.param, s
    s.stop()


def test_thirty_turns_continue_the_prompt_exactly(stack, ref):
    template_type, stack = stack
    proxy = stack.proxies[0]
    before = prompt_counts(proxy)
    # No system message: the template adds its default one before the first message.
    sess = Session(stack, MODEL, MAX_TOKENS, proxy)
    turns = sess.run(0, TURNS)
    assert [t.path for t in turns] == ["full"] + ["incremental"] * (TURNS - 1)
    assert counted(before, prompt_counts(proxy)) == {"full": 1, "incremental": TURNS - 1}
    assert all(t.answer.content for t in turns), [t.answer for t in turns]
    rows = export_rows(stack, sess.session_id)
    assert [r["interaction_id"] for r in rows] == [t.answer.id for t in turns]
    if template_type == "hf":
        check_hf(ref, rows, turns)
    else:
        check_concat(ref, rows, turns)
