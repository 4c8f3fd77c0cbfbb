"""The harnesses on the real bundled model, SmolLM2-135M-Instruct (8k context) on a CPU SGLang
engine, inside a network namespace with only loopback; the engine's requests and answers are
logged by a relay in front of it (scripted_engine.py --relay).

- mini-swe-agent and OpenCode fit its context: each runs to its end (mini-swe-agent bounded
  to 4 steps: a 135M model may never submit) and every call the engine answered is exported
  exactly, its trained spans what the engine sampled under the prompt it saw.
- Claude Code does not (its first prompt is ~20k of this model's tokens, its tools written
  into the prompt): it gets a clear refusal naming the prompt's size and the limit, exits
  with an error, and no request reaches the engine.

CI's "SmolLM2 engine" stage (scripts/test-all.sh, real_model_tests).
"""

from __future__ import annotations

import os

import pytest
from harness_checks import (
    check_exported_exactly,
    check_spans_are_sampled,
    require_harnesses,
    result_of,
    run_driver,
    transcript,
)

pytestmark = pytest.mark.engine
SCENARIOS = ["mini:mini", "opencode:opencode", "claude:claude"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from areal_cli.errors import CLIError
    from areal_cli.models import resolve_short_name

    try:
        resolve_short_name("smollm2")
    except CLIError as e:
        if os.environ.get("AREAL_TEST_REQUIRE_REAL_MODEL") == "1":
            raise
        pytest.skip(str(e))
    require_harnesses()
    return run_driver(tmp_path_factory.mktemp("smol-harnesses"), "smollm2", SCENARIOS, 1800)


@pytest.mark.parametrize("name", ["mini", "opencode"])
def test_harness_runs_to_its_end_on_the_real_model(results, name):
    r = result_of(results, name)
    assert r["rc"] == 0, transcript(r)
    assert r["engine_calls"], "no request reached the engine"
    if name == "mini":
        # Its own ends: submitted, out of steps, or three answers in a row with no tool call.
        ends = ("Submitted", "LimitsExceeded", "RepeatedFormatError")
        assert r["trajectory"]["info"]["exit_status"] in ends


@pytest.mark.parametrize("name", ["mini", "opencode"])
def test_every_real_model_call_is_exported_exactly(results, name):
    r = result_of(results, name)
    check_exported_exactly(r)
    check_spans_are_sampled(r)


def test_claude_code_is_refused_clearly_for_the_context(results):
    r = result_of(results, "claude")
    said = r["stdout"] + r["stderr"]
    assert r["rc"] not in (0, -1), transcript(r)  # an error exit, not a hang (-1: timed out)
    # The proxy's 400 as Claude Code shows it: the prompt's size and the limit it passes.
    [shown] = [ln for ln in said.splitlines() if ln.startswith("API Error: 400")][:1] or [said]
    assert "the prompt is" in shown and "tokens" in shown, transcript(r)
    assert "8186" in shown or "8192" in shown, transcript(r)
    assert not r["engine_calls"], "a prompt longer than the context reached the engine"
