"""Small pieces on their own: settings, the key check, SSE framing, URL checks."""

from __future__ import annotations

import pytest

from areal_gateway.auth import Authenticator, bearer_key
from areal_gateway.external import normalize_base_url
from areal_gateway.openai.sse import DONE, frame
from areal_gateway.settings import (
    DEFAULT_ADMIN_KEY,
    Settings,
    SettingsError,
    is_loopback,
    load_settings,
    validate,
)
from areal_runtime.errors import ServiceError


def test_settings_precedence_flag_env_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("AREAL_GATEWAY_MAX_BODY_BYTES", "AREAL_GATEWAY_ROUTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AREAL_ADMIN_API_KEY", "k" * 20)
    monkeypatch.setenv("AREAL_INTERNAL_TOKEN", "t" * 20)
    s = load_settings(["--router-addr", "127.0.0.1:5"])
    assert (
        s.max_body_bytes == 8 * 1024 * 1024 and s.request_timeout == 3600 and s.mode == "inference"
    )
    assert s.admin_api_key == "k" * 20 and s.internal_token == "t" * 20
    monkeypatch.setenv("AREAL_GATEWAY_MAX_BODY_BYTES", "100")
    assert load_settings(["--router-addr", "h:1"]).max_body_bytes == 100
    assert load_settings(["--router-addr", "h:1", "--max-body-bytes", "7"]).max_body_bytes == 7
    assert "k" * 20 not in repr(s) and "t" * 20 not in repr(s)


def test_secrets_are_not_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(["--router-addr", "h:1", "--admin-api-key", "x"])
    with pytest.raises(SystemExit):
        load_settings(["--help"])
    out = capsys.readouterr().out
    assert "--router-addr" in out and "--max-body-bytes" in out and "--drain-timeout" in out
    assert "admin-api-key" not in out and "internal-token" not in out


def test_validate_refusals() -> None:
    ok = Settings(router_addr="h:1", admin_api_key="secret-key-123456")
    validate(ok)
    with pytest.raises(SettingsError, match="router-addr"):
        validate(Settings(admin_api_key="x"))
    with pytest.raises(SettingsError, match="AREAL_ADMIN_API_KEY"):
        validate(Settings(router_addr="h:1"))
    default = Settings(router_addr="h:1", admin_api_key=DEFAULT_ADMIN_KEY)
    validate(default)  # loopback: allowed
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(SettingsError, match="default admin key"):
            validate(Settings(router_addr="h:1", admin_api_key=DEFAULT_ADMIN_KEY, host=host))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.3.4.5") and not is_loopback("0.0.0.0")


def test_authenticate() -> None:
    auth = Authenticator("admin-key-abcdefgh")
    p = auth.authenticate("admin-key-abcdefgh")
    assert p.is_admin and p.session_id == ""
    with pytest.raises(ServiceError) as e:
        auth.authenticate(None)
    assert e.value.http_status == 401 and e.value.code == "missing_api_key"
    with pytest.raises(ServiceError) as e:
        auth.authenticate("admin-key-abcdefgX")
    assert e.value.http_status == 401 and e.value.code == "invalid_api_key"
    auth.add_session_key("sk-session-1", "s1")
    p = auth.authenticate("sk-session-1")
    assert not p.is_admin and p.session_id == "s1"
    auth.remove_session_key("sk-session-1")
    with pytest.raises(ServiceError):
        auth.authenticate("sk-session-1")


def test_bearer_key() -> None:
    assert bearer_key("Bearer abc") == "abc"
    assert bearer_key("bearer   abc ") == "abc"
    assert bearer_key("Basic abc") is None
    assert bearer_key("Bearer ") is None
    assert bearer_key(None) is None


def test_sse_frames() -> None:
    assert frame(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert frame(b'{\n"a": 1\n}') == b'data: {\ndata: "a": 1\ndata: }\n\n'
    assert DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "url",
    ["ftp://h/v1", "h/v1", "http:///v1", "http://u:p@h/v1", "http://h/v1?x=1", "javascript:x"],
)
def test_bad_base_urls(url: str) -> None:
    with pytest.raises(ServiceError) as e:
        normalize_base_url(url)
    assert e.value.http_status == 400 and e.value.param == "base_url"


def test_good_base_url_is_normalized() -> None:
    assert normalize_base_url(" https://api.example.com/v1/ ") == "https://api.example.com/v1"


def test_every_served_endpoint_has_its_own_metrics_label():
    """RL, Responses and Messages calls are labelled by endpoint (not `other`), an id in a
    path never becomes a label value."""
    from areal_gateway.metrics import endpoint_label

    assert endpoint_label("/v1/responses") == "responses"
    assert endpoint_label("/v1/messages") == "messages"
    assert endpoint_label("/rl/start_session") == "rl_start_session"
    assert endpoint_label("/rl/export_trajectories") == endpoint_label("/export_trajectories")
    assert endpoint_label("/rl/sessions/sess-1") == endpoint_label("/rl/sessions/sess-2")
    assert endpoint_label("/v1/sessions/abc/history") == "agent_sessions"
    assert endpoint_label("/admin/models/m") == "admin"
    assert endpoint_label("/nope") == "other"
