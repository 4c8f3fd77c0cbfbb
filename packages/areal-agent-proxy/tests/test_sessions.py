"""Agent sessions' idle timeouts: the proxy's, or a shorter one a session was created with."""

from __future__ import annotations

from areal_agent_proxy.sessions import IDLE_TIMEOUT_KEY, AgentSessions


def test_a_session_may_have_a_shorter_idle_timeout() -> None:
    sessions = AgentSessions(timeout=1800)
    short = sessions.create("short", "", {IDLE_TIMEOUT_KEY: 300, "task": 1})
    plain = sessions.create("plain", "", {"task": 2})
    longer = sessions.create("longer", "", {IDLE_TIMEOUT_KEY: 99999})
    # The key is the proxy's: the agent never sees it in the session's metadata.
    assert short.metadata == {"task": 1} and longer.metadata == {}
    assert sessions.timeout_of(short) == 300
    assert sessions.timeout_of(plain) == 1800
    assert sessions.timeout_of(longer) == 1800  # never longer than the proxy's
    t = short.last_active_at
    assert [s.session_id for s in sessions.idle(t + 301)] == ["short"]
    assert {s.session_id for s in sessions.idle(t + 1801)} == {"short", "plain", "longer"}


def test_a_bad_idle_timeout_is_the_proxys() -> None:
    sessions = AgentSessions(timeout=60)
    for i, bad in enumerate((0, -5, "10", True, None)):
        s = sessions.create(f"s{i}", "", {IDLE_TIMEOUT_KEY: bad})
        assert sessions.timeout_of(s) == 60 and s.metadata == {}
