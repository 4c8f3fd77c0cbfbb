"""Fixtures of the `areal inf` suites (helpers live in cli_helpers.py)."""

from __future__ import annotations

import pytest
from cli_helpers import Areal


@pytest.fixture
def areal(tmp_path):
    """A fresh AREAL_HOME per test; asserts nothing of it is left running afterwards."""
    a = Areal(tmp_path / "home")
    yield a
    left = a.kill_leftovers()
    assert not left, f"processes left running: {left}"


@pytest.fixture(scope="module")
def module_areal(tmp_path_factory):
    a = Areal(tmp_path_factory.mktemp("home"))
    yield a
    a("inf", "stop", "--force")
    left = a.kill_leftovers()
    assert not left, f"processes left running: {left}"
