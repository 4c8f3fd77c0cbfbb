"""Session ids and session API keys (minted and checked by the gateway, verified by the proxy).

A key reads `areal-sk-<session_id>.<random>.<mac>`, where

    mac = base64url(HMAC-SHA256(signing_key, "<session_id>.<random>")[:16])   (22 characters)

Two independent checks guard a key:

* The gateway checks the MAC (`SessionKeys.verify`) before it routes anything, so a key it
  did not mint (a forged, truncated or altered one, or another session's MAC) is a 401 that
  never reaches the router: it pins nothing and costs no router state. The check is
  stateless (no lookup, nothing stored per key), so a restarted gateway accepts the keys of
  the one before as long as it is given the same secret.
* The proxy holding the session keeps only the key's SHA-256 and compares in constant time
  (`key_matches`), so a key acts only on its own session and a leaked state file holds no key.

The signing key is derived from one secret, `AREAL_SESSION_KEY_SECRET` (the CLI generates it
at `run`, keeps it in the service's 0600 secrets file and gives it to the gateway only; the
watchdog re-reads it when it restarts the gateway). It is derived with a label, so the secret
is used for nothing else. Without a secret, `SessionKeys.from_secret("")` is a random key of
this process: keys then die with it.

Keys without a MAC (`areal-sk-<id>.<secret>`, minted before it existed) are refused: sessions
live for one run of a service anyway.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

KEY_PREFIX = "areal-sk-"
SECRET_ENV = "AREAL_SESSION_KEY_SECRET"
# A secret shorter than this is refused at start (the CLI's has 43 characters).
MIN_SECRET_CHARS = 16
MAC_BYTES = 16
_MAC_CHARS = 22  # base64url of 16 bytes, unpadded
# Domain separation: the signing key is HMAC(secret, label), never the secret itself.
_LABEL = b"areal-session-key-mac-v1"
# No minted key comes near this; a longer bearer string is refused before any hashing.
_MAX_KEY_CHARS = 512


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


class SessionKeys:
    """Mints session keys under one signing key and checks that a key was minted by it."""

    __slots__ = ("_key",)

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else secret
        if not raw:
            raise ValueError("a session key secret must not be empty")
        self._key = hmac.new(raw, _LABEL, hashlib.sha256).digest()

    @classmethod
    def from_secret(cls, secret: str) -> SessionKeys:
        """The keys of `secret`; with none, this process's random keys (`process_keys`)."""
        return cls(secret) if secret else _PROCESS

    def _mac(self, body: str) -> str:
        # hmac.digest: OpenSSL's one-shot HMAC, a few times cheaper than an hmac.new object
        # (the MAC is checked on every request a session key makes).
        return _b64(hmac.digest(self._key, body.encode("ascii"), "sha256")[:MAC_BYTES])

    def mint(self, session_id: str) -> str:
        if not session_id or "." in session_id or not session_id.isascii():
            # The id is read back from the key up to the first dot.
            raise ValueError(f"not a session id: {session_id!r}")
        body = f"{session_id}.{secrets.token_urlsafe(24)}"
        return f"{KEY_PREFIX}{body}.{self._mac(body)}"

    def verify(self, key: str) -> str | None:
        """The session a key was minted for, or None when its MAC is not this signer's (or
        it is no session key at all). The MAC is compared in constant time."""
        if len(key) > _MAX_KEY_CHARS or not key.isascii() or not key.startswith(KEY_PREFIX):
            return None
        body, dot, mac = key[len(KEY_PREFIX) :].rpartition(".")
        sid, dot2, rand = body.partition(".")
        if not (dot and dot2 and sid and rand and "." not in rand and len(mac) == _MAC_CHARS):
            return None
        if not hmac.compare_digest(self._mac(body).encode(), mac.encode()):
            return None
        return sid


# Without a configured secret: random per process (a gateway given none, tests, tools that
# mint keys for a proxy they run in-process).
_PROCESS = SessionKeys(secrets.token_bytes(32))


def process_keys() -> SessionKeys:
    return _PROCESS


def mint_key(session_id: str) -> str:
    """A key under this process's random signing key: for a proxy or gateway run in this
    process without a secret (tests, benchmarks). A gateway mints with its own `SessionKeys`."""
    return _PROCESS.mint(session_id)


def session_of(key: str) -> str | None:
    """The session id a key *claims*, unverified (a MAC is checked by `SessionKeys.verify`):
    for a holder of a key it was given, e.g. the agent side reading its RL session's id."""
    if not key.startswith(KEY_PREFIX):
        return None
    sid, dot, secret = key[len(KEY_PREFIX) :].partition(".")
    return sid if dot and sid and secret else None


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str, stored_hash: str) -> bool:
    return hmac.compare_digest(key_hash(key), stored_hash)
