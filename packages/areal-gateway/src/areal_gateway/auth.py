"""Who is calling: one function turns a bearer key into a `Principal`.

Endpoints never compare keys themselves: they call `Authenticator.authenticate(key)` (or
`principal(request)`), then decide with `Principal.is_admin` / `Principal.session_id`.
Session keys are checked statelessly: a key the gateway minted carries an HMAC of its
session id under the gateway's signing key (`areal_runtime.session_keys.SessionKeys`), so a
forged or altered key is a 401 here, before anything is routed or pinned at the router, and a
restarted gateway given the same secret accepts the keys of the one before. Keys added with
`add_session_key` (tests, tools) are looked up by their SHA-256 digest, so the lookup reveals
nothing about a key's prefix. The admin key is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request

from areal_runtime.errors import PermissionDenied, Unauthenticated
from areal_runtime.session_keys import SessionKeys, process_keys


@dataclass(frozen=True, slots=True)
class Principal:
    api_key: str
    is_admin: bool
    # Non-empty for a session key: the session it may act on.
    session_id: str = ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Authenticator:
    def __init__(self, admin_key: str, session_keys: SessionKeys | None = None) -> None:
        if not admin_key:
            raise ValueError("an admin key is required")
        self._admin = admin_key.encode()
        # None: this process's random signing key (its keys die with the process).
        self.session_keys = session_keys or process_keys()
        self._sessions: dict[bytes, str] = {}

    def mint_session_key(self, session_id: str) -> str:
        """A key for `session_id` that `authenticate` accepts (so does the next gateway given
        the same secret)."""
        return self.session_keys.mint(session_id)

    # --- session keys (RL API) ---
    def add_session_key(self, key: str, session_id: str) -> None:
        self._sessions[_digest(key)] = session_id

    def remove_session_key(self, key: str) -> None:
        self._sessions.pop(_digest(key), None)

    # --- the one check ---
    def authenticate(self, key: str | None) -> Principal:
        if not key:
            raise Unauthenticated(
                "Missing API key: send 'Authorization: Bearer <key>'.", code="missing_api_key"
            )
        if hmac.compare_digest(key.encode(), self._admin):
            return Principal(api_key=key, is_admin=True)
        session_id = self._sessions.get(_digest(key)) if self._sessions else None
        if session_id is None:
            # Only a key this gateway's signing key minted: a forged one must not reach the
            # router (it would pin an unknown session there). The proxy holding the session
            # still checks the key's hash (the key may be a session's that ended).
            session_id = self.session_keys.verify(key)
        if session_id is not None:
            return Principal(api_key=key, is_admin=False, session_id=session_id)
        raise Unauthenticated("Invalid API key.", code="invalid_api_key")

    def principal(self, request: Request) -> Principal:
        return self.authenticate(bearer_key(request.headers.get("authorization")))


def bearer_key(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def require_admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise PermissionDenied("This endpoint needs the admin key.", code="admin_key_required")
