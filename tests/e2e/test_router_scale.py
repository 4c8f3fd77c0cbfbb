"""The router's control plane at 64 replicas, as `benchmarks/scale_sim.py` measures it.

64 simulated proxies (the real ProxyService contract, one host process; benchmarks/README.md
shows a simulated proxy costs the router what a real one does: 0.5 % vs 0.3 % of a core at
64) behind the real router and gateway, registered as one model through the gateway. The
issue's targets: router idle CPU at most 1 % of a core, route decisions p99 at most 1 ms, a
dead replica unroutable within the health interval; registration well under a second.
"""

from __future__ import annotations

import argparse
import sys

import pytest
from testpaths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import scale_sim

from areal_router.settings import RouterSettings

N = 64


@pytest.fixture(scope="module")
def row() -> dict:
    args = argparse.Namespace(real=0, window=8.0, settle=4.0, routes=500, router_args="")
    return scale_sim.measure(N, args)


def test_the_router_idles_below_one_percent_of_a_core_at_64_replicas(row):
    assert row["router_idle_cpu_pct"] <= 1.0, row


def test_route_decisions_stay_under_a_millisecond(row):
    assert row["decision_p99_le_ms"] <= 1.0, row


def test_a_dead_replica_is_unroutable_within_the_health_interval(row):
    assert row["dead_to_unroutable_s"] <= RouterSettings().health_interval, row


def test_registering_64_replicas_takes_well_under_a_second(row):
    assert row["register_s"] < 1.0, row
