"""uvicorn's httptools protocol with two limits uvicorn lacks: slow and idle clients.

uvicorn times out a keep-alive connection only after a response, and any byte resets that
timer; a connection that sends nothing, or a request's head or body a byte at a time, stays
open for ever (800 such connections from one client were all still open after 150 s). Here:

* a connection has `read_timeout` seconds to send a whole request, head and body, counted
  from when it opens or its previous response ends. Past that it is closed: a request that
  had begun gets a 408 first, an idle connection is just closed (as an idle keep-alive
  connection is);
* one client address keeps at most `idle_per_client` connections alive between requests,
  and holds at most that many connections that have sent nothing.

The second limit never closes a connection the client may have written to. A server cannot
tell an idle keep-alive connection from one whose next request is on the wire, so closing
one loses that request (a pool of 500 lost 4 in 10 that way). Instead:

* a connection that has served a request is never closed for the limit. Past the client's
  `idle_per_client` kept connections, a response carries `Connection: close`, so the
  client's own HTTP library retires the connection after reading it: nothing is in flight
  on it, nothing is lost, and the pool reconnects as it needs;
* a connection that has sent nothing is shed only after `silent_grace` seconds of silence
  (a real client writes its request as soon as it connects; a flood of connections opened
  at once is accepted before its requests are read) and only when the kernel holds no
  byte of it unread. Past that, the longest silent go first, as many as exceed the limit.

A request whose head and body have arrived is the app's from then on (its own deadlines);
nothing here touches a response in progress.
"""

from __future__ import annotations

import array
import asyncio
import fcntl
import termios
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TIMEOUT_BODY = (
    b'{"error":{"message":"The request was not received in time.",'
    b'"type":"invalid_request_error","code":"request_timeout","param":null}}'
)
_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\nconnection: close\r\n\r\n"
) + _TIMEOUT_BODY


def _unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this socket that the loop has not read yet (1 when that
    cannot be known, so that such a connection is never taken for a silent one)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 1
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf, True)
    except OSError:
        return 1
    return buf[0]


class _Peer:
    """One client address's connections under the limits."""

    __slots__ = ("kept", "silent")

    def __init__(self) -> None:
        # Connections that stay open after their response (at most idle_per_client).
        self.kept: set[_GuardedProtocol] = set()
        # Connections that have sent no byte yet, oldest first.
        self.silent: OrderedDict[_GuardedProtocol, None] = OrderedDict()


class _GuardedProtocol(HttpToolsProtocol):
    read_timeout: float = 60.0
    idle_per_client: int = 256
    silent_grace: float = 2.0
    # Per client address (one registry per server class, see guarded_protocol).
    peers: dict[str, _Peer] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._grace_timer: asyncio.TimerHandle | None = None
        self._peer = ""
        self._reading = False  # bytes of a request arrived, not yet all of it
        self._silent = True  # no byte received yet

    # -- the read deadline --
    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._reading:
            self.transport.write(_TIMEOUT)
        self.transport.close()

    # -- the per-client limits --
    def _peer_state(self) -> _Peer | None:
        if not self._peer:
            return None
        peer = self.peers.get(self._peer)
        if peer is None:
            peer = self.peers[self._peer] = _Peer()
        return peer

    def _shed_silent(self) -> None:
        """Close the longest-silent connections of this client past its limit: those silent
        for `silent_grace` with nothing unread (the others get their own check later)."""
        self._grace_timer = None
        peer = self.peers.get(self._peer)
        if peer is None or not self._silent:
            return
        excess = len(peer.silent) - self.idle_per_client
        for conn in list(peer.silent):
            if excess <= 0:
                break
            if conn._grace_timer is not None or conn.transport.is_closing():
                continue  # still in its grace, or already going
            if _unread_bytes(conn.transport):
                continue  # its first request is here, not yet read: it is not silent
            excess -= 1
            conn._forget()
            conn._disarm()
            conn.transport.close()

    def _spoke(self) -> None:
        self._silent = False
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        peer = self.peers.get(self._peer)
        if peer is not None:
            peer.silent.pop(self, None)

    def _keep_or_close(self) -> None:
        """A request has begun: this connection stays open after the response only while
        the client's kept connections are within the limit; else the response says
        `Connection: close` (uvicorn then closes it once the response is written)."""
        peer = self._peer_state()
        if peer is None or self.cycle is None or not self.cycle.keep_alive:
            return
        if self in peer.kept:
            return
        if len(peer.kept) < self.idle_per_client:
            peer.kept.add(self)
        else:
            self.cycle.keep_alive = False

    def _forget(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        peer = self.peers.get(self._peer)
        if peer is None:
            return
        peer.kept.discard(self)
        peer.silent.pop(self, None)
        if not peer.kept and not peer.silent:
            del self.peers[self._peer]

    # -- uvicorn's hooks --
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else ""
        self._arm()
        peer = self._peer_state()
        if peer is not None:
            peer.silent[self] = None
            self._grace_timer = self.loop.call_later(self.silent_grace, self._shed_silent)

    def data_received(self, data: bytes) -> None:
        if self._silent:
            self._spoke()
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = True

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._keep_or_close()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = False
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._forget()
        super().connection_lost(exc)


def guarded_protocol(
    read_timeout: float, idle_per_client: int, silent_grace: float = 2.0
) -> type[HttpToolsProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` with these limits (and its own registry
    of clients' connections)."""
    return type(
        "GuardedHttpProtocol",
        (_GuardedProtocol,),
        {
            "read_timeout": read_timeout,
            "idle_per_client": idle_per_client,
            "silent_grace": silent_grace,
            "peers": {},
        },
    )
