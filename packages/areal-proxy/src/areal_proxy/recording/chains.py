"""A session's turns as chains: the tree a harness's session really is.

A harness's session is not one line: sub-agents run their own conversations under the same
key, compaction replaces the history with a summary, side calls (a title, a summary) have
nothing to do with the trajectory. A chain is a run of turns each of which continues the
exact ids (prompt + sampled output) of the one before; the export gives one row per chain.

- A turn joins its lineage parent's chain when its prompt continues the parent's exact ids
  and the parent is still the chain's last turn (the first turn to continue it, in the order
  recorded); otherwise it starts a chain of its own.
- Each chain names why it started (`reason`) and the chain it came from (`parent`):
  `root` (the session's first conversation: no chain before it), `fork` (it continues a turn
  that another turn had already continued, or a sibling choice of one request), the prompt
  builder's fallback (`history_edited`, `not_cached`, `render_changed`,
  `tokenizer_unsupported`: prompt/incremental.py), `retokenized` (its lineage parent's turn
  was rendered into other ids), `unlinked` (the request extends no recorded turn and names
  no fallback: a completion), `side_call` / `main_call` (marked otherwise than the chain it
  continues). The parent chain holds the lineage parent, else the turn recorded last before
  the chain's first turn started; "" for none.
- Side calls: a request may say what it is (`x-areal-call: side|main`, Interaction
  .call_kind). A marked turn continues a chain only where the chain is unmarked or marked
  alike (a side call never joins an unmarked chain, which may be the one trained). An
  unmarked chain is a side call when its first request declares no tools while another chain
  of the session declares some (a harness's title or summary call; its agents and sub-agents
  all have tools).
- Certified spans: every turn's prompt hash (recording/spans.py, taken as it was recorded) is
  checked against the chain's ids before the turn's output: a turn whose prefix differs from
  what it was sampled under is refused (not exported), and the chain is split there; what
  follows is a chain of its own, `prefix_mismatch`, whose parent is the chain split.
  A turn recorded before prompt hashes existed carries none and is exported uncertified.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from areal_proxy.common.records import Interaction
from areal_proxy.recording.spans import pack_ids, prompt_hasher

log = logging.getLogger(__name__)

SIDE, MAIN = "side", "main"
CALL_KINDS = (SIDE, MAIN)


@dataclass(slots=True)
class Chain:
    chain_id: str
    turns: list[Interaction]
    reason: str
    # The chain it came from ("" for none).
    parent: str = ""
    side: bool = False
    # The first call kind a turn of it was marked with ("" for none).
    mark: str = ""
    # The turns' certified spans in the chain's ids: (start, end, prompt hash).
    spans: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def last(self) -> Interaction:
        return self.turns[-1]


def continues(child: Interaction, parent: Interaction) -> bool:
    """Whether `child`'s prompt continues `parent`'s exact prompt + output ids."""
    n = len(parent.prompt_ids) + len(parent.output_ids)
    return (
        child.parent_id == parent.interaction_id
        and child.inherited == n
        and child.prompt_ids[: len(parent.prompt_ids)] == parent.prompt_ids
        and child.prompt_ids[len(parent.prompt_ids) : n] == parent.output_ids
    )


def _may_join(mark: str, kind: str) -> bool:
    """Whether a turn marked `kind` continues a chain marked `mark` ("": unmarked)."""
    return not kind or kind == mark or (kind == MAIN and not mark)


def _fallback(prompt_path: str) -> str:
    return prompt_path.split(":", 1)[1] if prompt_path.startswith("full:") else ""


def build(turns: list[Interaction]) -> list[Chain]:
    """A session's chains, from its turns in the order recorded; each chain's turns in order.
    Chains come in the order of their first turn; spans are not yet certified (`certify`)."""
    by_id = {it.interaction_id: it for it in turns}
    chain_of: dict[str, Chain] = {}
    out: list[Chain] = []
    # Chains whose parent was found by time, not lineage, with their first turn's index.
    by_time: list[tuple[Chain, int]] = []
    for i, it in enumerate(turns):
        parent = by_id.get(it.parent_id) if it.parent_id else None
        reason = ""
        if parent is not None and parent.interaction_id in chain_of and continues(it, parent):
            chain = chain_of[parent.interaction_id]
            if chain.last is not parent:
                reason = "fork"
            elif not _may_join(chain.mark, it.call_kind):
                reason = f"{it.call_kind}_call"
            else:
                chain.turns.append(it)
                chain.mark = chain.mark or it.call_kind
                chain_of[it.interaction_id] = chain
                continue
        if parent is not None and parent.interaction_id in chain_of:
            came_from = chain_of[parent.interaction_id].chain_id
        else:
            before = _latest_before(turns, i)
            came_from = chain_of[before.interaction_id].chain_id if before is not None else ""
        if not reason:
            if not came_from:
                reason = "root"
            elif fallback := _fallback(it.prompt_path):
                reason = fallback
            elif parent is not None:
                reason = "retokenized"
            else:
                reason = "unlinked"
        chain = Chain(it.interaction_id, [it], reason, came_from, mark=it.call_kind)
        chain_of[it.interaction_id] = chain
        out.append(chain)
        if parent is None:
            by_time.append((chain, i))
    _decide_sides(out)
    _past_side_calls(turns, chain_of, by_time)
    return out


def _past_side_calls(
    turns: list[Interaction], chain_of: dict[str, Chain], by_time: list[tuple[Chain, int]]
) -> None:
    """A trained chain found its parent by time: never a side call. A harness's title call
    starts beside its first turn and may finish first; the main conversation came from no
    title, so its parent is the latest trained chain before it, and with none it is the
    session's `root`."""
    for chain, i in by_time:
        if chain.side or not chain.parent or not chain_of[chain.parent].side:
            continue
        started = turns[i].created_at
        chain.parent = ""
        for j in range(i - 1, -1, -1):
            before = chain_of[turns[j].interaction_id]
            if turns[j].finished_at <= started and not before.side:
                chain.parent = before.chain_id
                break
        if not chain.parent:
            chain.reason = "root"


def _latest_before(turns: list[Interaction], i: int) -> Interaction | None:
    """The turn recorded last before turns[i] started (turns are in the order they finished,
    so the walk back stops at the first that finished in time)."""
    started = turns[i].created_at
    for j in range(i - 1, -1, -1):
        if turns[j].finished_at <= started:
            return turns[j]
    return None


def _decide_sides(chains: list[Chain]) -> None:
    with_tools = [c.chain_id for c in chains if any(t.tools_declared for t in c.turns)]
    for c in chains:
        if c.mark:
            c.side = c.mark == SIDE
        else:
            others = len(with_tools) - (c.chain_id in with_tools)
            c.side = c.turns[0].tools_declared == 0 and others > 0


def certify(chain: Chain) -> list[Chain]:
    """`chain` with each turn's span checked against its prompt hash: the chain itself when
    every span holds, else the runs of turns that hold (a refused turn is in none of them)."""
    ids = chain.last.prompt_ids + chain.last.output_ids
    h = prompt_hasher()
    at = 0
    pieces: list[Chain] = []
    current: Chain | None = None
    refused: list[str] = []
    for t in chain.turns:
        start = len(t.prompt_ids)
        h.update(pack_ids(ids[at:start]))
        at = start
        if t.prompt_hash and h.hexdigest() != t.prompt_hash:
            refused.append(t.interaction_id)
            current = None
            continue
        if current is None:
            if pieces or refused:
                current = Chain(
                    t.interaction_id, [], "prefix_mismatch", chain.chain_id, chain.side, chain.mark
                )
            else:
                current = Chain(
                    chain.chain_id, [], chain.reason, chain.parent, chain.side, chain.mark
                )
            pieces.append(current)
        current.turns.append(t)
        current.spans.append((start, start + len(t.output_ids), t.prompt_hash))
    if refused:
        log.warning(
            "export: %d turn(s) of chain %s refused: their prefix differs from the prompt "
            "they were sampled under (%s)",
            len(refused),
            chain.chain_id,
            ", ".join(refused),
        )
    return pieces


def of_session(turns: list[Interaction]) -> list[Chain]:
    """A session's certified chains, in the order of their last turn."""
    pieces = [p for c in build(turns) for p in certify(c)]
    pieces.sort(key=lambda c: c.last.seq)
    return pieces
