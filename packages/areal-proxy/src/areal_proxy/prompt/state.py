"""What a session's turn leaves in memory for its next turn, and the bounded cache of it.

A turn whose request extends the previous one (the normal case of an agent's conversation)
continues from its parent's `PromptState` instead of rendering and tokenizing the whole
conversation again (prompt/incremental.py), and takes its parent's interaction from here
instead of rebuilding it from SQLite. Nothing here is needed for correctness: a turn whose
parent is not cached (evicted, or the proxy restarted) takes the full path, and says so.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from areal_proxy.common.records import Interaction

# Cached turns kept per session: its latest turn, and a couple of siblings for harnesses
# that run turns of one session side by side (parallel tool calls) or retry one.
TURNS_PER_SESSION = 3


@dataclass(frozen=True, slots=True)
class PromptState:
    """The token sequence a next turn may continue, with the text it stands for.

    `hf`: `ids` are the prompt's, `text` is the rendered prompt up to its last cut, and
    `cut_chars[i]` / `cut_tokens[i]` say that text[:cut_chars[i]] tokenizes to
    ids[:cut_tokens[i]] whatever follows it (prompt/cuts.py). `concat`: `ids` are the
    prompt's and `answer` the answer's (kept apart: the next prompt copies both once, rather
    than each turn copying its whole sequence twice), `text` the prompt's rendering, its
    generation prompt included (a next rendering that starts with it has the answer's turn
    right after: prompt/boundary.py), and no cuts.

    `json`: a JSON array of the ids (the engine request of the prompt they came from), whose
    `json[1:json_end]` encodes exactly those a next prompt takes over (hf: up to the last cut;
    concat: all): a next engine request encodes only what is new, and copies the rest once."""

    text: str
    ids: list[int]
    cut_chars: tuple[int, ...] = ()
    cut_tokens: tuple[int, ...] = ()
    json: bytes = b""
    json_end: int = 0
    answer: list[int] = field(default_factory=list)

    @property
    def kept(self) -> int:
        """How many leading ids a next prompt takes over (what `json` encodes)."""
        return self.cut_tokens[-1] if self.cut_tokens else len(self.ids)

    def kept_json(self) -> memoryview:
        """The inside of a JSON array of the kept ids (no copy)."""
        return memoryview(self.json)[1 : self.json_end]

    def nbytes(self) -> int:
        # The text, the list's pointers (its ints are shared: prompt/incremental.py), the JSON.
        return (
            sys.getsizeof(self.text)
            + 8 * (len(self.ids) + len(self.answer))
            + len(self.json)
            + 16 * len(self.cut_chars)
        )


@dataclass(slots=True)
class CachedTurn:
    interaction: Interaction
    state: PromptState | None
    # The request body's size: a next body this much bigger or less is a continuation's.
    body_bytes: int
    nbytes: int = 0
    # The lineage hash of the turn's conversation (its messages and answer): a next turn
    # that repeats them exactly hashes only its new messages (recording/lineage.py).
    conversation_hash: bytes = b""


@dataclass(slots=True)
class _SessionTurns:
    turns: OrderedDict[str, CachedTurn] = field(default_factory=OrderedDict)
    nbytes: int = 0


class TurnCache:
    """The last few turns of each live session, least recently used sessions evicted first
    once their estimated size passes `max_bytes`. Used from the recording thread (get,
    put, drop) and the event loop (`body_bytes`): one lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._sessions: OrderedDict[str, _SessionTurns] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str, interaction_id: str) -> CachedTurn | None:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                return None
            self._sessions.move_to_end(session_id)
            return s.turns.get(interaction_id)

    def latest(self, session_id: str) -> CachedTurn | None:
        with self._lock:
            s = self._sessions.get(session_id)
            return next(reversed(s.turns.values())) if s is not None and s.turns else None

    def body_bytes(self, session_id: str) -> int:
        """The size of the session's latest cached request body (0: none cached)."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or not s.turns:
                return 0
            return next(reversed(s.turns.values())).body_bytes

    def put(self, session_id: str, turn: CachedTurn) -> None:
        if self.max_bytes <= 0:
            return
        it = turn.interaction
        turn.nbytes = (
            (turn.state.nbytes() if turn.state is not None else 0)
            + 8 * (len(it.prompt_ids) + 2 * len(it.output_ids))
            # The parsed messages: their text and the objects around it.
            + 2 * turn.body_bytes
        )
        if turn.state is not None and turn.state.ids is it.prompt_ids:
            turn.nbytes -= 8 * len(it.prompt_ids)  # one list, counted once
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                s = self._sessions[session_id] = _SessionTurns()
            self._sessions.move_to_end(session_id)
            old = s.turns.pop(it.interaction_id, None)
            if old is not None:
                s.nbytes -= old.nbytes
                self.nbytes -= old.nbytes
            s.turns[it.interaction_id] = turn
            s.nbytes += turn.nbytes
            self.nbytes += turn.nbytes
            while len(s.turns) > TURNS_PER_SESSION:
                _, gone = s.turns.popitem(last=False)
                s.nbytes -= gone.nbytes
                self.nbytes -= gone.nbytes
            # The session just used stays, even alone over the budget: its next turn is
            # the one most likely to come.
            while self.nbytes > self.max_bytes and len(self._sessions) > 1:
                _, evicted = self._sessions.popitem(last=False)
                self.nbytes -= evicted.nbytes
                self.evictions += 1

    def drop(self, session_ids: list[str]) -> None:
        with self._lock:
            for sid in session_ids:
                s = self._sessions.pop(sid, None)
                if s is not None:
                    self.nbytes -= s.nbytes
