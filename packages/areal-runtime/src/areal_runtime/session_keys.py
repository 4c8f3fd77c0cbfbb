"""Session ids and session API keys (minted by the gateway, verified by the proxy).

A key reads `areal-sk-<session_id>.<secret>`: the gateway learns the session
from the key without a lookup and routes to the proxy the session is pinned
to; the proxy keeps only the key's SHA-256 and compares in constant time, so
a key can act only on its own session and a leaked state file holds no key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "areal-sk-"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def mint_key(session_id: str) -> str:
    return f"{KEY_PREFIX}{session_id}.{secrets.token_urlsafe(24)}"


def session_of(key: str) -> str | None:
    """The session id a key claims, or None if it is not a session key."""
    if not key.startswith(KEY_PREFIX):
        return None
    sid, dot, secret = key[len(KEY_PREFIX) :].partition(".")
    return sid if dot and sid and secret else None


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_matches(key: str, stored_hash: str) -> bool:
    return hmac.compare_digest(key_hash(key), stored_hash)
