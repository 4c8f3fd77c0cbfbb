"""Running the harness driver inside a network namespace, and the checks every harness test
makes of its result: the engine's log (what it received and sampled) against the exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness_setup import installed

HERE = Path(__file__).resolve().parent
# unshare: a network namespace with only loopback, and a pid namespace whose first process is
# the driver, so that nothing the stack or a harness started outlives it.
_UNSHARE = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc"]


def namespace_prefix() -> list[str]:
    """The command prefix that runs a command in a fresh network namespace, or a skip."""
    prefix = _UNSHARE if os.geteuid() == 0 else ["unshare", "--map-root-user", *_UNSHARE[1:]]
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        pytest.skip(
            "the harness tests run in a network namespace with only loopback: `unshare --net` "
            "needs root (CI runs as root) or unprivileged user namespaces"
        )
    return prefix


def require_harnesses() -> dict[str, str]:
    exes = installed()
    if not exes:
        reason = "harnesses not installed: run scripts/install-harnesses.sh (bootstrap does)"
        if os.environ.get("AREAL_TEST_REQUIRE_HARNESSES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return exes


def run_driver(out: Path, engine: str, scenarios: list[str], timeout: float) -> dict[str, Any]:
    """Each scenario's result (harness_driver.py), by name; `_driver` holds its timings."""
    prefix = namespace_prefix()
    argv = [
        *prefix,
        sys.executable,
        str(HERE / "harness_driver.py"),
        "--out",
        str(out),
        "--engine",
        engine,
    ]
    for s in scenarios:
        argv += ["--scenario", s]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (
        f"driver failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    )
    results: dict[str, Any] = {"_driver": json.loads((out / "driver.json").read_text())}
    for s in scenarios:
        name = s.split(":")[0]
        results[name] = json.loads((out / f"{name}.json").read_text())
    return results


def result_of(results: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in results:
        pytest.skip(f"no result for {name} (a results folder from a run without it)")
    r = results[name]
    assert "error" not in r, f"scenario {name} did not run:\n{r['error']}"
    return r


def transcript(r: dict[str, Any]) -> str:
    return f"rc={r['rc']}\n--- stdout\n{r['stdout'][-4000:]}\n--- stderr\n{r['stderr'][-4000:]}"


def answered_calls(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine calls that produced an answer (not the ones failed on purpose)."""
    return [c for c in r["engine_calls"] if not c["failed"]]


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of 1 in a loss mask, as [start, end)."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def check_exported_exactly(r: dict[str, Any]) -> None:
    """Every answered engine call is one individual row: the engine's input ids + the ids it
    sampled, logprobs to 1e-6, loss mask 0 on the prompt and 1 on the output; no other row."""
    calls = answered_calls(r)
    rows = r["rows_individual"]
    assert calls, "the engine saw no call"
    unmatched = list(rows)
    for c in calls:
        want = c["input_ids"] + c["output_ids"]
        hits = [row for row in unmatched if row["input_ids"] == want]
        assert len(hits) == 1, (
            f"engine call {c['n']} (step {c['step']}, {len(c['input_ids'])} prompt ids) is in "
            f"{len(hits)} rows"
        )
        row = hits[0]
        unmatched.remove(row)
        p, o = len(c["input_ids"]), len(c["output_ids"])
        assert row["loss_mask"] == [0] * p + [1] * o, f"call {c['n']}: loss mask"
        assert row["logprobs"][:p] == [0.0] * p
        assert row["logprobs"][p:] == pytest.approx(c["logprobs"], abs=1e-6), f"call {c['n']}"
    assert not unmatched, f"{len(unmatched)} exported rows match no engine call"


def check_retry_recorded_once(r: dict[str, Any]) -> None:
    """The call the engine failed on purpose came again (the harness retried it) and the
    recording holds it once: one row of that prompt, with the retry's answer."""
    failed = [c for c in r["engine_calls"] if c["failed"]]
    assert len(failed) == 1, f"expected one call failed on purpose, got {len(failed)}"
    [f] = failed
    prompt = f["input_ids"]
    retries = [c for c in answered_calls(r) if c["n"] > f["n"] and c["input_ids"] == prompt]
    assert len(retries) == 1, f"the failed call was answered {len(retries)} times after it"
    rows = [row for row in r["rows_individual"] if row["input_ids"][: len(prompt)] == prompt]
    # Rows whose output starts right after that prompt (a later turn only extends it).
    same_prompt = [row for row in rows if row["loss_mask"][len(prompt) : len(prompt) + 1] == [1]]
    assert [row["input_ids"] for row in same_prompt] == [prompt + retries[0]["output_ids"]]


def _prompt_hash() -> Any:
    """The certified spans' prompt hash (areal_client.spans, branch chains), or None."""
    try:
        from areal_client.spans import prompt_hash
    except ImportError:
        return None
    return prompt_hash


def check_spans_are_sampled(r: dict[str, Any]) -> None:
    """Every trained span of every concat row is what the engine sampled, under exactly the
    prompt the engine saw (the row's ids before the span); where rows carry certified spans,
    each is that span with the hash of the engine's own input ids."""
    sampled = {(tuple(c["input_ids"]), tuple(c["output_ids"])): c for c in answered_calls(r)}
    for row in r["rows_concat"]:
        for a, b in spans(row["loss_mask"]):
            key = (tuple(row["input_ids"][:a]), tuple(row["input_ids"][a:b]))
            assert key in sampled, (
                f"row {row['interaction_id']}: span [{a}, {b}) is not what the engine sampled "
                f"under that prefix"
            )
            c = sampled[key]
            assert row["logprobs"][a:b] == pytest.approx(c["logprobs"], abs=1e-6)
        if "spans" in row and (hash_of := _prompt_hash()) is not None:
            want = []
            for a, b in spans(row["loss_mask"]):
                c = sampled[(tuple(row["input_ids"][:a]), tuple(row["input_ids"][a:b]))]
                want.append([a, b, hash_of(c["input_ids"])])
            assert row["spans"] == want, f"row {row['interaction_id']}: certified spans"


def main_chain_rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The concat rows that hold a main (not side) engine call."""
    main = {
        (tuple(c["input_ids"]), tuple(c["output_ids"])) for c in answered_calls(r) if not c["side"]
    }
    out = []
    for row in r["rows_concat"]:
        if any(
            (tuple(row["input_ids"][:a]), tuple(row["input_ids"][a:b])) in main
            for a, b in spans(row["loss_mask"])
        ):
            out.append(row)
    return out


def check_one_chain(r: dict[str, Any]) -> None:
    """The harness's main conversation is one chain: every main call continues the ids the
    one before it received and sampled, so the concat export is one row holding them all."""
    rows = main_chain_rows(r)
    n_main = len([c for c in answered_calls(r) if not c["side"]])
    fallbacks = r["session_status"].get("prompt", {}).get("fallbacks")
    assert len(rows) == 1, f"main conversation in {len(rows)} chains; fallbacks {fallbacks}"
    assert len(spans(rows[0]["loss_mask"])) == n_main


def check_side_calls_marked(r: dict[str, Any], expect_side: bool) -> None:
    """Rows of side calls (no tools: a title, a summary) are marked side, the others not."""
    calls = answered_calls(r)
    side = {(tuple(c["input_ids"]), tuple(c["output_ids"])) for c in calls if c["side"]}
    if expect_side:
        assert side, "expected the harness to make a side call (e.g. a title)"
    rows = r["rows_individual"]
    for row in rows:
        p = len(row["loss_mask"]) - sum(row["loss_mask"])  # individual: prompt, then output
        key = (tuple(row["input_ids"][:p]), tuple(row["input_ids"][p:]))
        assert bool(row["side"]) == (key in side), f"row {row['interaction_id']} side mark"


def check_tool_call_status(r: dict[str, Any]) -> None:
    """Where rows carry their tool-call parse status (branch chains), each individual row
    counts the calls the engine wrote, all parsed."""
    rows = r["rows_individual"]
    assert rows, "no rows exported"
    written = {
        (tuple(c["input_ids"]), tuple(c["output_ids"])): c["tool_calls"] for c in answered_calls(r)
    }
    for row in rows:
        p = len(row["loss_mask"]) - sum(row["loss_mask"])
        n = written[(tuple(row["input_ids"][:p]), tuple(row["input_ids"][p:]))]
        status = row["tool_calls"]
        assert (status["called"], status["parsed"]) == (n, n), f"row {row['interaction_id']}"
        assert status["declared"] >= (1 if n else 0)
