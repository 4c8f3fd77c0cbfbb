"""Who is calling: one function turns a bearer key into a `Principal`.

Endpoints never compare keys themselves: they call `Authenticator.authenticate(key)` (or
`principal(request)`), then decide with `Principal.is_admin` / `Principal.session_id`.
Session keys (minted by the RL API) plug in through `add_session_key` without touching the
endpoints. The admin key is compared in constant time; session keys are looked up by their
SHA-256 digest, so the lookup reveals nothing about a key's prefix.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request

from areal_runtime.errors import PermissionDenied, Unauthenticated
from areal_runtime.session_keys import session_of


@dataclass(frozen=True, slots=True)
class Principal:
    api_key: str
    is_admin: bool
    # Non-empty for a session key: the session it may act on.
    session_id: str = ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Authenticator:
    def __init__(self, admin_key: str) -> None:
        if not admin_key:
            raise ValueError("an admin key is required")
        self._admin = admin_key.encode()
        self._sessions: dict[bytes, str] = {}

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
            # An RL session key names its session; the proxy holding the session checks
            # the key's hash, so the gateway keeps no key and loses none on restart.
            session_id = session_of(key)
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
