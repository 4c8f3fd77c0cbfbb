"""Slow and idle clients (slowloris): a connection that sends nothing, or a request a byte at
a time, is closed after --request-read-timeout; one client's idle connections are bounded by
--max-idle-connections-per-client. Real sockets against the real gateway (uvicorn)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from conftest import ADMIN_KEY, Stack

from areal_gateway.http_protocol import _GuardedProtocol

SILENT_GRACE = _GuardedProtocol.silent_grace


def _connect(url: str) -> socket.socket:
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `s` within `seconds`, and what it sent before."""
    s.settimeout(0.2)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(4096)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


@pytest.fixture(scope="module")
def guarded(stack: Stack):
    stack.register("m-slow")
    return stack.start_gateway(request_read_timeout=1.0, max_idle_connections_per_client=4)


def test_a_connection_that_sends_nothing_is_closed(guarded) -> None:
    s = _connect(guarded.url)
    try:
        closed, got = _closed_within(s, 5.0)
        assert closed and got == b""  # idle: closed without a word, as keep-alive is
    finally:
        s.close()


def test_partial_headers_get_a_408_and_are_closed(guarded) -> None:
    s = _connect(guarded.url)
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(3):  # a header line now and then resets nothing
            time.sleep(0.4)
            s.sendall(b"X-Slow: 1\r\n")
        closed, got = _closed_within(s, 5.0)
        assert closed
        assert got.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in got
    finally:
        s.close()


def test_a_body_that_trickles_is_closed(guarded) -> None:
    s = _connect(guarded.url)
    try:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {ADMIN_KEY}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        closed, _ = _closed_within(s, 5.0)
        assert closed
    finally:
        s.close()


@pytest.fixture(scope="module")
def capped(stack: Stack):
    return stack.start_gateway(request_read_timeout=30.0, max_idle_connections_per_client=4)


def test_idle_connections_per_client_are_bounded(capped) -> None:
    socks = [_connect(capped.url) for _ in range(6)]
    try:
        # A connection that has sent nothing is shed only after a grace (a real client's
        # first request may not be read yet when a flood of connections is accepted).
        time.sleep(SILENT_GRACE + 0.5)
        # The two silent longest were closed; the four newest are still open.
        closed = [_closed_within(s, 0.05)[0] for s in socks]
        assert closed == [True, True, False, False, False, False]
        # An open connection still serves its requests.
        socks[5].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        socks[5].settimeout(5)
        assert socks[5].recv(4096).startswith(b"HTTP/1.1 ")
    finally:
        for s in socks:
            s.close()


def _get_health(s: socket.socket) -> bytes:
    """One request on `s` and its whole response (head and body: /health is small)."""
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(5)
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_past_the_limit_a_response_says_connection_close(capped) -> None:
    # Six connections each with a request on it: none is closed under a request; the four
    # the client may keep stay open, the other two are told to close after their response.
    socks = [_connect(capped.url) for _ in range(6)]
    try:
        answers = [_get_health(s) for s in socks]
        assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        told_to_close = [b"connection: close" in a.lower() for a in answers]
        assert told_to_close == [False] * 4 + [True] * 2
        closed = [_closed_within(s, 0.3)[0] for s in socks]
        assert closed == [False] * 4 + [True] * 2
    finally:
        for s in socks:
            s.close()


def test_kept_connections_outlive_a_flood_of_silent_ones(capped) -> None:
    # Connections that served a request are never closed for the limit (the client may be
    # writing its next request on one): a flood of silent connections loses its own.
    time.sleep(0.2)  # the previous test's connections are gone
    kept = [_connect(capped.url) for _ in range(4)]
    flood: list[socket.socket] = []
    try:
        assert all(_get_health(s).startswith(b"HTTP/1.1 200 ") for s in kept)
        flood = [_connect(capped.url) for _ in range(8)]
        time.sleep(SILENT_GRACE + 0.5)
        assert [_closed_within(s, 0.05)[0] for s in kept] == [False] * 4
        assert sum(_closed_within(s, 0.05)[0] for s in flood) == 4
        assert all(_get_health(s).startswith(b"HTTP/1.1 200 ") for s in kept)
    finally:
        for s in kept + flood:
            s.close()


def test_keep_alive_and_a_slow_but_timely_request_still_work(guarded) -> None:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = {"model": "m-slow", "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(base_url=guarded.url, timeout=10) as c:
        for _ in range(3):  # one connection, reused across the pauses
            assert c.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
            time.sleep(0.5)
    # A request sent in two parts, within the deadline, is served.
    s = _connect(guarded.url)
    try:
        raw = (
            b"GET /health HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {ADMIN_KEY}\r\n".encode()
        )
        s.sendall(raw)
        time.sleep(0.5)
        s.sendall(b"\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    finally:
        s.close()
