"""Which exported rows a trainer gets: staleness on every row, a staleness bound, per-group
policies for groups with failed members, and the export's summary.

Staleness (docs/services.md, "Staleness"): a row's `min_version` and `max_version` are the
oldest and newest weight version of its trainable tokens as recorded (loss_mask 1 before any
masking; -1 for both when it has none), and its `staleness` is the proxy's current weight
version at export minus `min_version` (0 when it has no trainable token; never below 0, a
version set back makes none negative). A generation interrupted by a weight update keeps its
older tokens with their version, so a row may span versions.

The bound (`max_staleness`, η): a row is past it when `staleness > η`; it is dropped, or with
`stale="mark"` exported with `stale: true`. With `mask_stale_tokens`, the trainable tokens
older than `current - η` get loss_mask 0 instead, and only a row left with no trainable
token is past the bound.

Groups (`drop_incomplete_group`, `min_usable_group_size`): a member is usable when it did not
fail (its end named no failure) and has a row left after the bound. All or nothing drops a
group with any unusable member; a minimum exports the usable members' rows, or none when
fewer are usable. Without either, every member's rows are exported, a failed one's carrying
its `failure`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from areal_proxy.common.records import Session
from areal_runtime.errors import InvalidRequest

STALE_ACTIONS = ("drop", "mark")

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Policy:
    """What an export request asked of its rows (the defaults: every row, as before)."""

    max_staleness: int | None = None
    stale: str = "drop"
    mask_stale_tokens: bool = False
    drop_incomplete_group: bool = False
    min_usable_group_size: int = 0

    def check(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidRequest("max_staleness must be >= 0", param="max_staleness")
        if self.stale not in STALE_ACTIONS:
            raise InvalidRequest(f"stale must be one of {', '.join(STALE_ACTIONS)}", param="stale")
        if self.mask_stale_tokens and self.max_staleness is None:
            raise InvalidRequest(
                "mask_stale_tokens needs max_staleness (the bound tokens are masked past)",
                param="mask_stale_tokens",
            )
        if self.min_usable_group_size < 0:
            raise InvalidRequest(
                "min_usable_group_size must be >= 0", param="min_usable_group_size"
            )
        if self.drop_incomplete_group and self.min_usable_group_size:
            raise InvalidRequest(
                "give drop_incomplete_group or min_usable_group_size, not both",
                param="min_usable_group_size",
            )

    @property
    def by_group(self) -> bool:
        return self.drop_incomplete_group or self.min_usable_group_size > 0


@dataclass(slots=True)
class Summary:
    """What an export did, counted as its rows are read (complete once they all are)."""

    version: int
    exported: int = 0
    marked_stale: int = 0
    dropped_stale: int = 0
    masked_tokens: int = 0
    dropped_groups: int = 0
    dropped_group_rows: int = 0
    dropped_failed_rows: int = 0
    # Failed sessions of the export, whatever the policy: session, group, why.
    failed: list[dict[str, str]] = field(default_factory=list)
    # Staleness of the exported rows: staleness -> rows.
    staleness: Counter[int] = field(default_factory=Counter)

    def outcomes(self) -> dict[str, int]:
        """Rows by outcome, as the proxy's metrics count them (metrics.EXPORT_OUTCOMES)."""
        return {
            "exported": self.exported,
            "marked_stale": self.marked_stale,
            "dropped_stale": self.dropped_stale,
            "dropped_group": self.dropped_group_rows,
            "dropped_failed": self.dropped_failed_rows,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "exported": self.exported,
            "marked_stale": self.marked_stale,
            "dropped_stale": self.dropped_stale,
            "masked_tokens": self.masked_tokens,
            "dropped_groups": self.dropped_groups,
            "dropped_group_rows": self.dropped_group_rows,
            "dropped_failed_rows": self.dropped_failed_rows,
            "failed": self.failed,
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        }


def annotate(row: Row, version: int, failure: str) -> None:
    """Give `row` its staleness fields (module docstring) and its session's failure."""
    trained = [v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m]
    low = min(trained) if trained else -1
    row["min_version"] = low
    row["max_version"] = max(trained) if trained else -1
    row["staleness"] = max(0, version - low) if trained else 0
    row["stale"] = False
    row["failure"] = failure


def _within(row: Row, policy: Policy, version: int, summary: Summary) -> bool:
    """Apply the bound to an annotated row: mask, mark; False when it is to be dropped."""
    if policy.max_staleness is None:
        return True
    oldest_kept = version - policy.max_staleness
    if policy.mask_stale_tokens:
        mask = row["loss_mask"]
        for i, (m, v) in enumerate(zip(mask, row["versions"], strict=True)):
            if m and v < oldest_kept:
                mask[i] = 0
                summary.masked_tokens += 1
        past = row["max_version"] >= 0 and not any(mask)
    else:
        past = row["staleness"] > policy.max_staleness
    if not past:
        return True
    if policy.stale == "mark":
        row["stale"] = True
        summary.marked_stale += 1
        return True
    summary.dropped_stale += 1
    return False


def _bounded(
    session: Session, rows: Iterable[Row], policy: Policy, version: int, summary: Summary
) -> Iterator[Row]:
    if session.failure:
        summary.failed.append(
            {
                "session_id": session.session_id,
                "group_id": session.group_id,
                "failure": session.failure,
            }
        )
    for row in rows:
        annotate(row, version, session.failure)
        if _within(row, policy, version, summary):
            yield row


def _group(members: list[tuple[Session, list[Row]]], policy: Policy, summary: Summary) -> list[Row]:
    usable = [rows for s, rows in members if not s.failure and rows]
    every = sum(len(rows) for _, rows in members)
    if policy.drop_incomplete_group:
        keep = len(usable) == len(members)
    else:
        keep = len(usable) >= policy.min_usable_group_size
    if not keep:
        summary.dropped_groups += 1
        summary.dropped_group_rows += every
        return []
    out = [r for rows in usable for r in rows]
    summary.dropped_failed_rows += every - len(out)
    return out


def select(
    sessions: Iterable[tuple[Session, Iterable[Row]]],
    policy: Policy,
    version: int,
    summary: Summary,
) -> Iterator[Row]:
    """The rows of `sessions` (each session's rows as export built them) that `policy`
    keeps, annotated, in order; `summary` counts as they are read. With a group policy,
    a group's sessions must come together (one group's rows are held at a time)."""

    def counted(row: Row) -> Row:
        summary.exported += 1
        summary.staleness[row["staleness"]] += 1
        return row

    if not policy.by_group:
        for session, rows in sessions:
            for row in _bounded(session, rows, policy, version, summary):
                yield counted(row)
        return
    members: list[tuple[Session, list[Row]]] = []
    for session, rows in sessions:
        if members and members[-1][0].group_id != session.group_id:
            yield from map(counted, _group(members, policy, summary))
            members = []
        members.append((session, list(_bounded(session, rows, policy, version, summary))))
    if members:
        yield from map(counted, _group(members, policy, summary))


def by_group(sessions: list[Session]) -> list[Session]:
    """`sessions` with each group's together, groups in order of first appearance (the
    order `select` needs with a group policy)."""
    order: dict[str, list[Session]] = {}
    for s in sessions:
        order.setdefault(s.group_id, []).append(s)
    return [s for group in order.values() for s in group]
