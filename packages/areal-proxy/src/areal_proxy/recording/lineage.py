"""Parent of an interaction: the earlier one whose conversation is the longest prefix.

Upstream compares each new request against every earlier interaction (and
sorts them) on every insert, so recording cost grows with history. Here each
message prefix has a chained hash: finding the parent is one dict lookup per
message of the new request, whatever the session's length. Messages are compared in
their canonical form (areal_runtime.openai.messages): by meaning, so that an answer a
client echoes back with its tool calls' arguments re-serialized is still the answer.
"""

from __future__ import annotations

from typing import Any

from areal_runtime.openai.messages import chained as _chained
from areal_runtime.openai.messages import prefix_hashes


class Lineage:
    """Conversation-prefix index of one session."""

    __slots__ = ("_by_prefix",)

    def __init__(self) -> None:
        self._by_prefix: dict[bytes, str] = {}

    def parent_of(self, messages: list[dict[str, Any]]) -> tuple[str | None, int]:
        """(parent interaction id, number of messages it covers) for a new request."""
        parent, covered, _ = self.locate(messages)
        return parent, covered

    def locate(self, messages: list[dict[str, Any]]) -> tuple[str | None, int, bytes]:
        """`parent_of`, and the hash of all of `messages` (for `add_after`)."""
        hashes = prefix_hashes(messages)
        for k in range(len(hashes) - 1, -1, -1):
            iid = self._by_prefix.get(hashes[k])
            if iid is not None:
                return iid, k + 1, hashes[-1]
        return None, 0, hashes[-1] if hashes else b""

    def add_after(
        self, interaction_id: str, messages_hash: bytes, response: dict[str, Any]
    ) -> bytes:
        """`add`, for messages whose hash `locate` gave: the answer is the only message
        hashed again (a turn does not hash its whole conversation twice). Returns the
        conversation's hash, from which `extend` goes on."""
        key = _chained(messages_hash, response)
        self._by_prefix[key] = interaction_id
        return key

    @staticmethod
    def extend(conversation_hash: bytes, messages: list[dict[str, Any]]) -> bytes:
        """The hash of a conversation whose hash is known, followed by `messages`."""
        h = conversation_hash
        for m in messages:
            h = _chained(h, m)
        return h

    def add(
        self, interaction_id: str, messages: list[dict[str, Any]], response: dict[str, Any]
    ) -> None:
        """Index the conversation an interaction ends with (its messages + its answer)."""
        conv = [*messages, response]
        self._by_prefix[prefix_hashes(conv)[-1]] = interaction_id
