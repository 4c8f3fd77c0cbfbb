"""The `ray_cluster` fixture: a real two-node Ray cluster, one network + pid namespace per
node (see netns_cluster.py and docs/cluster.md, "How the tests build a cluster")."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
from netns_cluster import NetnsCluster, missing_requirements


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cluster: needs a real multi-node Ray cluster in network namespaces (root)"
    )


def _unavailable(reason: str) -> None:
    if os.environ.get("AREAL_TEST_REQUIRE_RAY") == "1":
        pytest.fail(f"AREAL_TEST_REQUIRE_RAY=1 but no netns Ray cluster: {reason}")
    pytest.skip(f"no netns Ray cluster: {reason}")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[NetnsCluster]:
    """Two nodes (head 198.18.0.11, worker 198.18.0.12), 2 CPUs each; always torn down.

    A test that kills a node must start it again (``start_node``) before it ends, so the
    session's cluster stays whole for the tests after it.
    """
    reason = missing_requirements()
    if reason is None and importlib.util.find_spec("ray") is None:
        reason = "ray is not installed (the areal-cli[ray] extra)"
    if reason is not None:
        _unavailable(reason)
    cluster = NetnsCluster(num_nodes=2)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
