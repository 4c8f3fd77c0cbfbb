"""Fault tests: SIGKILL / SIGSTOP each component kind of a supervised service under load.

Real binaries and the real CPU SGLang engine (tiny-parrot), loopback only, bounded in
requests and time; the work is benchmarks/fault_table.py, which also prints the table.
Slow (two engine starts on the CPU plus five fault rows): several minutes.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _engine_available() -> bool:
    from areal_cli import engines
    from areal_cli.errors import CLIError

    try:
        engines.resolve_python("sglang")
    except CLIError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(
        not all(
            shutil.which(b) or (BIN / b).exists()
            for b in (
                "areal-gateway",
                "areal-router",
                "areal-proxy",
                "areal-agent-proxy",
                "areal-agent-worker",
            )
        ),
        reason="service binaries not installed",
    ),
    pytest.mark.skipif(not _engine_available(), reason="no SGLang engine installed"),
]


def _fault_table():
    spec = importlib.util.spec_from_file_location(
        "fault_table", ROOT / "benchmarks" / "fault_table.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Eight fault rows with real engines restarting on 2 cores: minutes, not the suite's 300 s.
@pytest.mark.timeout(1800)
def test_fault_table(tmp_path, capsys):
    out = tmp_path / "faults.json"
    code = _fault_table().main(["--requests", "200", "--row-timeout", "150", "--json", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    # The service is sglang:d2, as `areal inf models` tells it: two replicas, each its own
    # engine process (the rows below then serve and fail over across both).
    (model,) = doc["models"]
    assert len(model["replicas"]) == 2 and len(model["workers"]) == 2, model
    with capsys.disabled():
        print()
        _fault_table().print_table(doc["rows"])
    # Eight fault rows and the big-client-pool row (no fault: every request of 500 connections
    # in waves of 500 answers 200).
    assert len(doc["rows"]) == 9
    (pool,) = [r for r in doc["rows"] if r["scenario"].startswith("big client pool")]
    assert pool["errors"] == 0 and pool["acked"] == pool["requests"] > 0, pool
    faults = [r for r in doc["rows"] if r is not pool]
    # Streams under way when an engine was killed all finished normally (migration, or they
    # ran on the other replica): none failed mid-answer.
    (mig,) = [r for r in doc["rows"] if r["scenario"] == "engine killed mid-stream (migration)"]
    done, total = (int(x) for x in mig["mid_stream"].split("/"))
    assert total > 0 and done == total, mig
    # A scale-down under load: no request failed, every stream under way finished.
    (drained,) = [r for r in doc["rows"] if r["scenario"] == "replica drained"]
    done, total = (int(x) for x in drained["mid_stream"].split("/"))
    assert drained["errors"] == 0 and done == total > 0, drained
    for row in faults:
        assert row["healthy_after_s"] is not None, row  # back within the row's bound
        assert row["lost"] in (0, "n/a"), row  # no acknowledged interaction lost
        if row is not drained:  # nothing to restart: the drain stopped its engine on purpose
            assert row["restarts"] >= 1, row  # the watchdog did it, not the test
        assert row["orphans_after_stop"] == 0, row
    assert doc["orphans"]["processes_with_home"] == []
    # Costly bodies beside ordinary chats: the floods are refused or answered, never a 5xx, and
    # the ordinary chats beside them all answer.
    assert len(doc["floods"]) >= 5, doc["floods"]
    for flood in doc["floods"]:
        assert flood["others_errors"] == {}, flood
        assert flood["others_n"] > 0, flood
        assert not [s for s in flood.get("big_statuses", {}) if str(s).startswith("5")], flood
