"""A Ray unit's processes get the operator's OTEL_* settings (tracing), never OTEL_*HEADERS."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_cli.cluster.ray_scheduler import unit_doc


def test_a_unit_carries_the_otel_settings_but_not_their_headers(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("AREAL_HOME", str(tmp_path))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer secret")
    monkeypatch.setenv("AREAL_INTERNAL_TOKEN", "token")
    launcher = SimpleNamespace(group="inf", service="svc", state={"ray": {}})
    doc = unit_doc(launcher, "unit-0", {}, [], [])
    assert doc["env"] == {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
    }
