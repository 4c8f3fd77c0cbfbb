"""uvicorn's httptools protocol with two limits uvicorn lacks: slow and idle clients.

uvicorn times out a keep-alive connection only after a response, and any byte resets that
timer; a connection that sends nothing, or a request's head or body a byte at a time, stays
open for ever (800 such connections from one client were all still open after 150 s). Here:

* a connection has `read_timeout` seconds to send a whole request, head and body, counted
  from when it opens or its previous response ends. Past that it is closed: a request that
  had begun gets a 408 first, an idle connection is just closed (as an idle keep-alive
  connection is);
* one client address holds at most `idle_per_client` idle connections (open, no request
  in progress); a new idle one past that closes the one idle longest.

A request whose head and body have arrived is the app's from then on (its own deadlines);
nothing here touches a response in progress.
"""

from __future__ import annotations

import asyncio
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


class _GuardedProtocol(HttpToolsProtocol):
    read_timeout: float = 60.0
    idle_per_client: int = 256
    # Idle connections by client address, longest idle first (one registry per server).
    idle: dict[str, OrderedDict[_GuardedProtocol, None]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._peer = ""
        self._reading = False  # bytes of a request arrived, not yet all of it

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

    # -- idle connections per client --
    def _now_idle(self) -> None:
        if not self._peer:
            return
        conns = self.idle.setdefault(self._peer, OrderedDict())
        conns[self] = None
        while len(conns) > self.idle_per_client:
            oldest, _ = conns.popitem(last=False)
            oldest._disarm()
            oldest.transport.close()

    def _now_busy(self) -> None:
        conns = self.idle.get(self._peer)
        if conns is not None:
            conns.pop(self, None)
            if not conns:
                del self.idle[self._peer]

    # -- uvicorn's hooks --
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else ""
        self._arm()
        self._now_idle()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = True
        self._now_busy()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading = False
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            self._arm()
            self._now_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._now_busy()
        super().connection_lost(exc)


def guarded_protocol(read_timeout: float, idle_per_client: int) -> type[HttpToolsProtocol]:
    """A protocol class for `uvicorn.Config(http=...)` with these limits (and its own registry
    of idle connections)."""
    return type(
        "GuardedHttpProtocol",
        (_GuardedProtocol,),
        {"read_timeout": read_timeout, "idle_per_client": idle_per_client, "idle": {}},
    )
