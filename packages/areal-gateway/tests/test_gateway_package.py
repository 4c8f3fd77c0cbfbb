"""The package installs and imports against its own dependencies only."""

from __future__ import annotations

import importlib.metadata

import areal_gateway


def test_version_matches_distribution_metadata():
    assert areal_gateway.__version__ == importlib.metadata.version("areal-gateway")
