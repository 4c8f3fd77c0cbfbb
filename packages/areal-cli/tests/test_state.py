"""State files: atomic, 0600, secrets apart, an exclusive lock across processes."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import textwrap

import pytest

from areal_cli import state as st
from areal_cli.errors import CLIError


def test_save_load_mode_and_layout(home):
    st.save("inf", "svc", {"service": "svc", "components": {}})
    p = home / "inf" / "services" / "svc.json"
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert st.load("inf", "svc")["service"] == "svc"
    assert st.list_services("inf") == ["svc"]
    assert st.list_services("agent") == []
    assert not list(p.parent.glob(".*tmp")), "no temp files left"


def test_secrets_are_a_separate_private_file(home):
    st.save("inf", "svc", {"service": "svc"})
    st.save_secrets("inf", "svc", {"admin_api_key": "k-123", "internal_token": "t-456"})
    sp = st.secrets_path("inf", "svc")
    assert stat.S_IMODE(sp.stat().st_mode) == 0o600
    assert "k-123" not in st.state_path("inf", "svc").read_text()
    assert st.load_secrets("inf", "svc")["admin_api_key"] == "k-123"
    st.remove("inf", "svc")
    assert not sp.exists() and st.load("inf", "svc") is None


def test_write_is_atomic_replace(home, monkeypatch):
    st.save("inf", "svc", {"v": 1})
    import os

    def boom(*a, **k):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", boom)
        with pytest.raises(OSError):
            st.save("inf", "svc", {"v": 2})
    assert st.load("inf", "svc")["v"] == 1
    assert [p.name for p in st.services_dir("inf").iterdir() if p.name.startswith(".")] == []


def test_corrupt_state_is_a_clear_error(home):
    st.services_dir("inf").mkdir(parents=True)
    st.state_path("inf", "svc").write_text("{not json")
    with pytest.raises(CLIError, match="corrupt state file"):
        st.load("inf", "svc")


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", "a" * 65, "a b"])
def test_bad_service_names(name):
    with pytest.raises(CLIError):
        st.check_name("service", name)


def test_lock_two_processes_race(home, tmp_path):
    """Two processes try the lock at once: exactly one gets it."""
    script = textwrap.dedent(
        """
        import sys, time
        from areal_cli import state as st
        from areal_cli.errors import CLIError
        time.sleep(float(sys.argv[1]) - time.time())
        try:
            with st.locked("inf", "svc"):
                print("won", flush=True)
                time.sleep(1.0)
        except CLIError as e:
            print("lost:", e.message, flush=True)
        """
    )
    import time

    start = str(time.time() + 0.8)
    procs = [
        subprocess.Popen([sys.executable, "-c", script, start], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = sorted(p.communicate(timeout=20)[0].strip() for p in procs)
    assert outs[1] == "won", outs
    assert outs[0].startswith("lost:") and "busy" in outs[0], outs


def test_lock_waits_when_asked(home):
    with st.locked("inf", "svc"):
        other = st.Lock("inf", "svc")
        with pytest.raises(CLIError, match="busy"):
            other.acquire(wait=0.2)
    with st.locked("inf", "svc", wait=0.2):
        pass


def test_state_json_roundtrip_is_plain_json(home):
    st.save("agent", "a", {"pairs": [{"index": 0}]})
    assert json.loads(st.state_path("agent", "a").read_text())["pairs"][0]["index"] == 0
