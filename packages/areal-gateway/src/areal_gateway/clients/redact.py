"""Errors a client sees name no internal address.

A proxy, engine or router error may carry the service's inner topology in its words: grpc's
"failed to connect to all addresses; last error: ipv4:10.0.0.7:50051", the proxy's "engine
unreachable at http://10.0.0.7:30000", the gateway's own "proxy 10.0.0.7:50051 failed". A
client can do nothing with those addresses and should not learn them. Every error that
comes back from an internal service as a 5xx is passed through `public` here: its words keep what
happened, the addresses are replaced, and the operator's log keeps the whole message.
"""

from __future__ import annotations

import logging
import re

from areal_runtime.errors import ServiceError

log = logging.getLogger("areal_gateway.errors")

PLACEHOLDER = "(an internal address)"

_ADDRESS = re.compile(
    r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>,;)\]]+"  # a URL: http://10.0.0.7:30000/generate
    r"|\b(?:ipv4|ipv6|unix|dns):[^\s'\"<>,;)]+"  # grpc's ipv4:10.0.0.7:50051
    r"|\[[0-9a-fA-F.]*:[0-9a-fA-F:.]*\](?::\d+)?"  # [::1]:50051 (not messages[0])
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"  # 10.0.0.7, 10.0.0.7:50051
    # host:port with a letter in the host: localhost:50051, node-3.cluster:30000
    r"|\b(?=[a-zA-Z0-9.-]*[a-zA-Z])[a-zA-Z0-9](?:[a-zA-Z0-9.-]*[a-zA-Z0-9])?:\d{2,5}\b"
)


def redact(text: str) -> str:
    """`text` with every internal address replaced."""
    return _ADDRESS.sub(PLACEHOLDER, text)


def public(err: ServiceError, source: str) -> ServiceError:
    """`err` as a client may see it (the same error, its message redacted). The whole
    message goes to the log when anything was taken out of it. A 4xx is about the caller's
    own input (an admin registering an address is told which one is wrong): kept whole."""
    if err.http_status < 500:
        return err
    clean = redact(err.message)
    if clean != err.message:
        log.warning("%s: %s (%d %s)", source, err.message, err.http_status, err.code or "")
        err.message = clean
        err.args = (clean,)
    return err
