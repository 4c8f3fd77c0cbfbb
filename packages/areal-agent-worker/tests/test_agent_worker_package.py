"""The package installs and imports against its own dependencies only."""

from __future__ import annotations

import importlib.metadata

import areal_agent_worker


def test_version_matches_distribution_metadata():
    assert areal_agent_worker.__version__ == importlib.metadata.version("areal-agent-worker")
