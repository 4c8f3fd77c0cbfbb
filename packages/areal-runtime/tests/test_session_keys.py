"""Session keys: minted with a MAC over the session id, checked statelessly (no lookup)."""

from __future__ import annotations

import base64

import pytest

from areal_runtime.session_keys import (
    KEY_PREFIX,
    SessionKeys,
    key_hash,
    key_matches,
    mint_key,
    new_id,
    process_keys,
    session_of,
)

SECRET = "a-session-key-secret-of-43-characters-xxxxx"


def _parts(key: str) -> tuple[str, str, str]:
    sid, rand, mac = key[len(KEY_PREFIX) :].split(".")
    return sid, rand, mac


def test_mint_then_verify_names_the_session() -> None:
    keys = SessionKeys(SECRET)
    sid = new_id("sess")
    key = keys.mint(sid)
    assert key.startswith(f"{KEY_PREFIX}{sid}.")
    _, rand, mac = _parts(key)
    assert len(base64.urlsafe_b64decode(mac + "==")) == 16 and len(rand) >= 32
    assert keys.verify(key) == sid
    assert session_of(key) == sid  # the claim, as the agent side reads it
    # The proxy's check is unchanged: SHA-256 of the whole key.
    assert key_matches(key, key_hash(key))
    assert keys.mint(sid) != key  # fresh randomness each time


def test_the_same_secret_verifies_across_instances() -> None:
    """What a restarted gateway relies on: the signing key is a function of the secret."""
    key = SessionKeys(SECRET).mint("sess-1")
    assert SessionKeys(SECRET).verify(key) == "sess-1"
    assert SessionKeys.from_secret(SECRET).verify(key) == "sess-1"


def test_a_different_signing_key_refuses() -> None:
    key = SessionKeys(SECRET).mint("sess-1")
    assert SessionKeys(SECRET + "x").verify(key) is None
    assert SessionKeys.from_secret("").verify(key) is None  # the process's random key
    assert SessionKeys(SECRET).verify(mint_key("sess-1")) is None


def test_wrong_mac_refused() -> None:
    keys = SessionKeys(SECRET)
    key = keys.mint("sess-1")
    sid, rand, mac = _parts(key)
    # Every single-character change of the MAC is caught.
    for i in range(len(mac)):
        c = "A" if mac[i] != "A" else "B"
        bad = f"{KEY_PREFIX}{sid}.{rand}.{mac[:i]}{c}{mac[i + 1 :]}"
        assert keys.verify(bad) is None, i
    # ... and so is a change of the random part or of the id under the same MAC.
    other = "x" if rand[-1] != "x" else "y"  # a real change whatever the random part ends with
    assert keys.verify(f"{KEY_PREFIX}{sid}.{rand[:-1]}{other}.{mac}") is None
    assert keys.verify(f"{KEY_PREFIX}sess-2.{rand}.{mac}") is None


def test_other_sessions_mac_refused() -> None:
    keys = SessionKeys(SECRET)
    _, rand_a, mac_a = _parts(keys.mint("sess-a"))
    assert keys.verify(f"{KEY_PREFIX}sess-b.{rand_a}.{mac_a}") is None


@pytest.mark.parametrize(
    "mangle",
    [
        lambda k: k[:-1],  # truncated MAC
        lambda k: k.rsplit(".", 1)[0],  # no MAC: the shape minted before MACs existed
        lambda k: k.rsplit(".", 1)[0] + ".",  # empty MAC
        lambda k: k + "A",  # MAC too long
        lambda k: k + ".more",  # extra part
        lambda k: k[len(KEY_PREFIX) :],  # no prefix
        lambda k: k.replace(".", "..", 1),  # empty random part
        lambda k: KEY_PREFIX + "." + k.split(".", 1)[1],  # empty id
        lambda k: k[:-2] + "é" + k[-1],  # non-ASCII
        lambda k: k + "=" * 600,  # absurdly long
        lambda k: "",
    ],
)
def test_malformed_keys_refused(mangle) -> None:
    keys = SessionKeys(SECRET)
    assert keys.verify(mangle(keys.mint("sess-1"))) is None


def test_legacy_key_without_mac_refused() -> None:
    assert SessionKeys(SECRET).verify(f"{KEY_PREFIX}sess-1.secretsecretsecret") is None
    assert process_keys().verify(f"{KEY_PREFIX}sess-1.secretsecretsecret") is None


def test_ids_that_cannot_round_trip_are_refused_at_mint() -> None:
    keys = SessionKeys(SECRET)
    for bad in ("", "a.b", "sé"):
        with pytest.raises(ValueError):
            keys.mint(bad)
    with pytest.raises(ValueError):
        SessionKeys("")


def test_process_keys_verify_mint_key() -> None:
    key = mint_key("sess-p")
    assert process_keys().verify(key) == "sess-p"
    assert SessionKeys.from_secret("") is process_keys()
