"""Unmodified coding-agent harnesses on areal: Claude Code, Codex CLI, OpenCode and
mini-swe-agent, as installed from npm and PyPI at the pins of scripts/install-harnesses.sh,
each run with an RL session key as its API key, inside a network namespace with only
loopback, against the scripted engine (scripted_engine.py: real tool calls for each
harness's own shell tool, every request's ids logged).

One driver run per module (harness_driver.py: one engine, one stack, the four harnesses one
after the other); the tests read its results. Per harness:
- it finishes its task: exit 0, its tool ran (the proof file it wrote; Codex, read-only by
  default, printed the marker), the final answer printed;
- every engine call is exported exactly once (individual rows: the engine's input ids and
  sampled ids, logprobs to 1e-6, loss mask), and the call the engine failed on purpose (the
  first at step 1) is recorded once, from the harness's retry;
- every trained span of every concat row is what the engine sampled under exactly the prompt
  it saw, and the main conversation is one chain;
- side calls (OpenCode's title) are marked side, and each row counts the tool calls the
  engine wrote, all parsed.

"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness_checks import (
    answered_calls,
    check_exported_exactly,
    check_one_chain,
    check_retry_recorded_once,
    check_side_calls_marked,
    check_spans_are_sampled,
    check_tool_call_status,
    require_harnesses,
    result_of,
    run_driver,
    transcript,
)
from scripted_engine import FINAL_TEXT, MARKER, PROOF_FILE

# name:harness:step whose first request the engine fails once (the harness retries it).
SCENARIOS = ["opencode:opencode:1", "mini:mini:1", "claude:claude:1", "codex:codex:1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if done := os.environ.get("AREAL_TEST_HARNESS_RESULTS"):
        # A driver output folder from an earlier run (quick iteration on the checks only).
        out = Path(done)
        return {f.stem: json.loads(f.read_text()) for f in out.glob("*.json")}
    require_harnesses()
    return run_driver(tmp_path_factory.mktemp("harnesses"), "scripted", SCENARIOS, timeout=1500)


def ran(results, name: str) -> dict:
    """The scenario's result."""
    return result_of(results, name)


@pytest.mark.parametrize("name", ["opencode", "mini", "claude", "codex"])
def test_harness_finishes_its_task(results, name):
    r = ran(results, name)
    assert r["rc"] == 0, transcript(r)
    calls = answered_calls(r)
    # The tool ran: its output (the marker, made by the shell) came back to the model twice.
    assert max(c["step"] for c in calls) >= 2, transcript(r)
    if name != "codex":
        assert r["files"].get(PROOF_FILE, "").strip() == MARKER, r["files"]
    if name == "mini":
        info = r["trajectory"]["info"]
        assert info["exit_status"] == "Submitted", info
        assert FINAL_TEXT in info["submission"]
    else:
        assert FINAL_TEXT in r["stdout"], transcript(r)


@pytest.mark.parametrize("name", ["opencode", "mini", "claude", "codex"])
def test_every_call_is_exported_exactly_once(results, name):
    r = ran(results, name)
    check_exported_exactly(r)


@pytest.mark.parametrize("name", ["opencode", "mini", "claude", "codex"])
def test_a_retried_call_is_recorded_once(results, name):
    r = ran(results, name)
    check_retry_recorded_once(r)


@pytest.mark.parametrize("name", ["opencode", "mini", "claude", "codex"])
def test_trained_spans_are_the_sampled_ids(results, name):
    r = ran(results, name)
    check_spans_are_sampled(r)


@pytest.mark.parametrize("name", ["opencode", "mini", "claude", "codex"])
def test_the_main_conversation_is_one_chain(results, name):
    r = ran(results, name)
    check_one_chain(r)


@pytest.mark.parametrize("name", ["opencode", "mini", "claude", "codex"])
def test_side_calls_are_marked(results, name):
    r = ran(results, name)
    # OpenCode names each session with a tool-less title call.
    check_side_calls_marked(r, expect_side=name == "opencode")


@pytest.mark.parametrize("name", ["opencode", "mini", "claude", "codex"])
def test_rows_count_the_tool_calls_parsed(results, name):
    r = ran(results, name)
    check_tool_call_status(r)


def test_streamed_and_not(results):
    """The harnesses that stream (Claude Code, Codex, OpenCode) made the engine stream; the one
    that does not (mini-swe-agent over litellm) did not: both paths recorded above."""
    for name, streams in (("opencode", True), ("mini", False)):
        r = result_of(results, name)
        assert {c["stream"] for c in r["engine_calls"]} == {streams}, name
