"""Mutual TLS for the internal gRPC calls, opt-in through the environment.

    port = tls.bind(server, f"{host}:{port}")      # instead of server.add_insecure_port
    ch = tls.channel(address, options=[...])       # instead of grpc.aio.insecure_channel

The contract, read once per process (the first `bind` or `channel`):

    AREAL_TLS_CA    the service CA's certificate (PEM): the only issuer a peer may have
    AREAL_TLS_CERT  this component's certificate (PEM)
    AREAL_TLS_KEY   its private key (PEM), a file only its owner can read (0600)

All three set: every server requires a client certificate from that CA, and every channel
verifies the server against it and presents its own. None set: plaintext, as before. Some
but not all, or a file that cannot be read or is not what it should be: `TLSConfigError`
(a `ValueError`, which each service's startup reports as a configuration error), naming the
variable and the file. TLS is in addition to the internal token (`auth.py`), not instead.

Why one certificate for all of a service's components, with the name `SERVER_NAME`: a
component listens on whichever node it was placed on, at an address (an IP, a port the OS
picked) known only once it runs, and clients dial that address. A certificate per address
would need the CA's key at every start and a SAN per IP. Instead the service's CA issues
one certificate whose SAN is DNS:areal-internal, every component holds it (as server and as
client), and every channel checks the server's certificate against that name
(`grpc.ssl_target_name_override`) rather than against the address it dialed. What a peer
proves is therefore "I hold this service's certificate", the same trust the shared internal
token gives, now also keeping out anyone who can reach the port without the service's key,
and encrypting the traffic. The CA is per service, so another service's certificate, whose
SAN is the same name, is refused.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

CA_ENV = "AREAL_TLS_CA"
CERT_ENV = "AREAL_TLS_CERT"
KEY_ENV = "AREAL_TLS_KEY"
ENV_VARS = (CA_ENV, CERT_ENV, KEY_ENV)
# The one name every certificate of a service carries (DNS SAN), and every client checks.
SERVER_NAME = "areal-internal"


class TLSConfigError(ValueError):
    """The AREAL_TLS_* environment is incomplete, or names a file that cannot be used."""


@dataclass(frozen=True)
class TLSConfig:
    """The PEM bytes of the service CA, this component's certificate and its key."""

    ca: bytes
    cert: bytes
    key: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _read(var: str, path: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{var}={path}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data or marker not in data:
        what = marker.decode().strip("- ").lower()
        raise TLSConfigError(f"{var}={path}: not a PEM {what}")
    return data


def load(environ: Mapping[str, str] | None = None) -> TLSConfig | None:
    """The TLS configuration `environ` (default `os.environ`) describes; None for plaintext.
    Raises `TLSConfigError`. An empty variable counts as unset."""
    env = os.environ if environ is None else environ
    paths = {var: env.get(var, "") for var in ENV_VARS}
    missing = [var for var, path in paths.items() if not path]
    if len(missing) == len(ENV_VARS):
        return None
    if missing:
        given = ", ".join(var for var in ENV_VARS if var not in missing)
        raise TLSConfigError(
            f"TLS needs all of {', '.join(ENV_VARS)}: {given} set but {', '.join(missing)} not"
        )
    key_path = paths[KEY_ENV]
    try:
        mode = os.stat(key_path).st_mode
    except OSError as exc:
        raise TLSConfigError(f"{KEY_ENV}={key_path}: cannot read: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TLSConfigError(
            f"{KEY_ENV}={key_path}: a private key others can read (mode "
            f"{stat.S_IMODE(mode):04o}); make it 0600"
        )
    return TLSConfig(
        ca=_read(CA_ENV, paths[CA_ENV], b"CERTIFICATE-----"),
        cert=_read(CERT_ENV, paths[CERT_ENV], b"CERTIFICATE-----"),
        key=_read(KEY_ENV, key_path, b"PRIVATE KEY-----"),
    )


@functools.cache
def config() -> TLSConfig | None:
    """This process's configuration, from its environment, read on first use (tests that
    change the environment call `config.cache_clear()`)."""
    return load()


def enabled() -> bool:
    return config() is not None


def bind(server: grpc.aio.Server, address: str) -> int:
    """Listen on `address` ("host:port"): with mTLS when configured, else plaintext. Returns
    the port, as `add_insecure_port` does."""
    cfg = config()
    if cfg is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, cfg.server_credentials())


def channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A channel to another component of this service at `address`: with mTLS (the server
    checked as `SERVER_NAME`) when configured, else plaintext. `options` as for gRPC."""
    cfg = config()
    if cfg is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(
        address,
        cfg.channel_credentials(),
        options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)],
    )
