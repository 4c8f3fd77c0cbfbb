"""Trajectory rows for a trainer, from a session's recorded interactions.

A row: `input_ids` (prompt + output, the stop token included), `loss_mask`
(0 on prompt tokens, 1 on generated ones), `logprobs` (0 on prompt tokens),
`versions` (-1 on prompt tokens, else the weight version that produced the
token), `reward`, `replicas` (which proxy's engine generated which tokens: `[index, proxy
id]` pairs over `input_ids` positions, each on until the next; several when a request
migrated to another replica mid-generation), and the ids that place it (session, group,
task, interaction). Every row also says which chain it belongs to (`chain_id`,
`chain_reason`, `parent_chain`), whether it is a side call (`side`), the certified span of
each trained turn (`spans`: [start, end, prompt hash]) and how the turns' tool calls parsed
(`tool_calls`): recording/chains.py.

Styles:
- `concat` (the default): one row per chain of turns whose prompts continue the exact token
  sequence of the turn before: the row is the last turn's tokens with every turn's output
  marked trainable. A turn whose prompt was re-tokenized (the `hf` template) cannot be laid
  on its parent's tokens exactly, so it starts a new chain instead of silently drifting.
- `individual`: one row per interaction, each naming the chain it belongs to.

`side_calls`: "include" (every row), "exclude" (rows that are not side calls), "only".

Every row also carries its staleness (`min_version`, `max_version`, `staleness`, `stale`) and
its session's `failure`; which rows are kept (a staleness bound, group policies) and the
export's summary: recording/selection.py.

Discount: rewards walk back over a session's turns, `r_i += discount * r_{i+1}`
(an unrewarded turn counts as 0). The choices of one request (`n`, same `response_id`) are
one step: alternatives, not a chain, so none adds to another; the turn before them gets the
mean of their returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from areal_proxy.common.records import Interaction, Session
from areal_proxy.recording import chains as chaining
from areal_proxy.recording import selection
from areal_proxy.recording.chains import Chain
from areal_proxy.recording.selection import Policy, Summary

STYLES = ("concat", "individual")
DEFAULT_STYLE = "concat"
SIDE_CALLS = ("include", "exclude", "only")


def discounted_rewards(turns: list[Interaction], discount: float) -> list[float]:
    # Steps: runs of consecutive turns that are choices of one response.
    steps: list[list[int]] = []
    for i, it in enumerate(turns):
        prev = turns[i - 1] if i else None
        if prev is not None and it.response_id and it.response_id == prev.response_id:
            steps[-1].append(i)
        else:
            steps.append([i])
    out = [0.0] * len(turns)
    later = 0.0  # the return of the step after this one
    for j in range(len(steps) - 1, -1, -1):
        carry = discount * later if j < len(steps) - 1 else 0.0
        for i in steps[j]:
            out[i] = (turns[i].reward or 0.0) + carry
        later = sum(out[i] for i in steps[j]) / len(steps[j])
    return out


def _runs(it: Interaction, recorder: str) -> list[tuple[int, str]]:
    """`it`'s replica runs over its output, each covering at least one token and naming a
    proxy other than the run before; none recorded (a row from before migration): all by
    the recording proxy."""
    n = len(it.output_ids)
    out: list[tuple[int, str]] = []
    for i, (start, replica) in enumerate(it.replicas or [(0, recorder)]):
        end = it.replicas[i + 1][0] if i + 1 < len(it.replicas) else n
        if start >= min(end, n):
            continue  # covers no token
        if out and out[-1][1] == replica:
            continue  # the same proxy goes on
        out.append((start, replica))
    return out


def _pairs(runs: list[tuple[int, str]]) -> list[list[Any]]:
    return [[i, r] for i, r in runs]


def _base(session: Session, it: Interaction, reward: float, chain: Chain) -> dict[str, Any]:
    return {
        "session_id": session.session_id,
        "group_id": session.group_id,
        "task_id": session.task_id,
        "interaction_id": it.interaction_id,
        # Several choices of one request (`n`) are sibling interactions of one response.
        "response_id": it.response_id or it.interaction_id,
        "choice_index": it.choice_index,
        "reward": reward,
        "finish_reason": it.finish_reason,
        "chain_id": chain.chain_id,
        "chain_reason": chain.reason,
        "parent_chain": chain.parent,
        "side": chain.side,
    }


def _tool_calls(turns: list[Interaction]) -> dict[str, int]:
    """How the row's turns' tool calls went: the most tools a request of them declared, the
    calls their outputs made, and how many of those the parser read."""
    return {
        "declared": max(t.tools_declared for t in turns),
        "called": sum(t.tool_calls_made for t in turns),
        "parsed": sum(t.tool_calls_parsed for t in turns),
    }


def _individual(
    session: Session,
    it: Interaction,
    span: tuple[int, int, str],
    reward: float,
    chain: Chain,
    recorder: str,
) -> dict[str, Any]:
    p = len(it.prompt_ids)
    row = _base(session, it, reward, chain)
    row.update(
        input_ids=it.prompt_ids + it.output_ids,
        loss_mask=[0] * p + [1] * len(it.output_ids),
        logprobs=[0.0] * p + it.logprobs,
        versions=[-1] * p + it.versions,
        interaction_ids=[it.interaction_id],
        replicas=_pairs([(p + at, replica) for at, replica in _runs(it, recorder)]),
        spans=[list(span)],
        tool_calls=_tool_calls([it]),
    )
    return row


def _concat(session: Session, chain: Chain, reward: float, recorder: str) -> dict[str, Any]:
    it = chain.last
    ids = it.prompt_ids + it.output_ids
    mask = [0] * len(ids)
    lps = [0.0] * len(ids)
    vers = [-1] * len(ids)
    runs: list[tuple[int, str]] = []
    for turn in chain.turns:
        start = len(turn.prompt_ids)
        # Each turn's runs where its output sits; a proxy that goes on from the turn
        # before (across the prompt text between them) is one run.
        for at, replica in _runs(turn, recorder):
            if not runs or runs[-1][1] != replica:
                runs.append((start + at, replica))
        for j, (lp, v) in enumerate(zip(turn.logprobs, turn.versions, strict=True)):
            mask[start + j] = 1
            lps[start + j] = lp
            vers[start + j] = v
    row = _base(session, it, reward, chain)
    row.update(
        input_ids=ids,
        loss_mask=mask,
        logprobs=lps,
        versions=vers,
        interaction_ids=[t.interaction_id for t in chain.turns],
        replicas=_pairs(runs),
        spans=[list(span) for span in chain.spans],
        tool_calls=_tool_calls(chain.turns),
    )
    return row


def _session_rows(
    session: Session,
    turns: list[Interaction],
    discount: float,
    recorder: str,
    style: str,
    side_calls: str = "include",
) -> Iterator[dict[str, Any]]:
    rewards = discounted_rewards(turns, discount)
    reward = {t.interaction_id: r for t, r in zip(turns, rewards, strict=True)}
    wanted = [
        c
        for c in chaining.of_session(turns)
        if side_calls == "include" or c.side == (side_calls == "only")
    ]
    if style != "individual":
        for chain in wanted:
            yield _concat(session, chain, reward[chain.last.interaction_id], recorder)
        return
    # One row per interaction, in the order they were recorded.
    each = [(it, span, c) for c in wanted for it, span in zip(c.turns, c.spans, strict=True)]
    each.sort(key=lambda x: x[0].seq)
    for it, span, chain in each:
        yield _individual(session, it, span, reward[it.interaction_id], chain, recorder)


def individual_rows(
    session: Session, turns: list[Interaction], discount: float, recorder: str = "proxy"
) -> Iterator[dict[str, Any]]:
    """One row per interaction (whose span is certified), in the order recorded."""
    return rows([(session, turns)], "individual", discount, recorder)


def concat_rows(
    session: Session, turns: list[Interaction], discount: float, recorder: str = "proxy"
) -> Iterator[dict[str, Any]]:
    """One row per chain, in the order of each chain's last turn."""
    return rows([(session, turns)], "concat", discount, recorder)


def rows(
    sessions: Iterable[tuple[Session, list[Interaction]]],
    style: str,
    discount: float,
    recorder: str = "proxy",
    side_calls: str = "include",
    *,
    version: int = 0,
    policy: Policy | None = None,
    summary: Summary | None = None,
) -> Iterator[dict[str, Any]]:
    """`recorder`: the recording proxy's id, the replica of tokens recorded without one.
    `version`: the current weight version, which each row's staleness is measured against;
    `policy`: which rows are kept (recording/selection.py; every row by default), counted in
    `summary` as they are read."""
    per_session = (
        (session, _session_rows(session, turns, discount, recorder, style, side_calls))
        for session, turns in sessions
    )
    return selection.select(
        per_session, policy or Policy(), version, summary if summary is not None else Summary(0)
    )
