"""Staleness as data, the export's staleness bound and group policies (recording/selection.py),
and failure reasons kept by the store: pure functions and a real SQLite book."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from areal_proxy.common.records import Interaction, Session
from areal_proxy.recording import export
from areal_proxy.recording.selection import Policy, Summary
from areal_proxy.recording.sessions import SessionBook
from areal_proxy.recording.store import Store
from areal_runtime.errors import InvalidRequest
from areal_runtime.session_keys import mint_key, new_id


def _turn(sid: str, seq: int, versions: list[int]) -> Interaction:
    out = list(range(100, 100 + len(versions)))
    return Interaction(
        interaction_id=f"{sid}-i{seq}",
        session_id=sid,
        seq=seq,
        messages=[{"role": "user", "content": str(seq)}],
        response={"role": "assistant", "content": "a"},
        prompt_ids=[1, 2],
        output_ids=out,
        logprobs=[-0.5] * len(out),
        versions=versions,
        finish_reason="stop",
        reward=1.0,
    )


def _session(sid: str, group: str = "g1", failure: str = "") -> Session:
    return Session(sid, group, "t", "h", "m", 1.0, 1.0, failure=failure)


def _rows(
    sessions: list[tuple[Session, list[Interaction]]], version: int, **policy: Any
) -> tuple[list[dict[str, Any]], Summary]:
    summary = Summary(version)
    rows = list(
        export.rows(
            sessions, "individual", 1.0, version=version, policy=Policy(**policy), summary=summary
        )
    )
    return rows, summary


def test_every_row_carries_its_versions_and_staleness() -> None:
    # One generation interrupted by a weight update: tokens of versions 2 and 3.
    s = _session("s1")
    [row], summary = _rows([(s, [_turn("s1", 0, [2, 2, 3])])], version=5)
    assert (row["min_version"], row["max_version"], row["staleness"]) == (2, 3, 3)
    assert row["stale"] is False and row["failure"] == ""
    assert summary.exported == 1 and summary.staleness == {3: 1}
    # A version set back below the row's makes no negative staleness.
    [row], _ = _rows([(s, [_turn("s1", 0, [4])])], version=1)
    assert row["staleness"] == 0
    # No trainable token: -1 versions, staleness 0.
    [row], _ = _rows([(s, [_turn("s1", 0, [])])], version=3)
    assert (row["min_version"], row["max_version"], row["staleness"]) == (-1, -1, 0)


def test_drop_and_mark_past_the_bound() -> None:
    s = _session("s1")
    turns = [_turn("s1", 0, [1]), _turn("s1", 1, [2]), _turn("s1", 2, [3])]
    # Current version 3, bound 1: version 1 (staleness 2) is past it; 2 and 3 are not.
    rows, summary = _rows([(s, turns)], 3, max_staleness=1)
    assert [r["min_version"] for r in rows] == [2, 3]
    assert (summary.exported, summary.dropped_stale) == (2, 1)
    assert summary.staleness == {1: 1, 0: 1}
    rows, summary = _rows([(s, turns)], 3, max_staleness=1, stale="mark")
    assert [r["stale"] for r in rows] == [True, False, False]
    assert (summary.exported, summary.marked_stale, summary.dropped_stale) == (3, 1, 0)
    # Bound 0 keeps only the current version's rows; no bound keeps all.
    assert [r["min_version"] for r in _rows([(s, turns)], 3, max_staleness=0)[0]] == [3]
    assert len(_rows([(s, turns)], 3)[0]) == 3


def test_mask_stale_tokens_masks_only_the_old_tokens() -> None:
    s = _session("s1")
    # A generation that spans versions 1, 2, 3 (two weight updates under it), and one all old.
    turns = [_turn("s1", 0, [1, 1, 2, 3]), _turn("s1", 1, [0, 0])]
    rows, summary = _rows([(s, turns)], 3, max_staleness=1, mask_stale_tokens=True)
    [row] = rows  # the all-old one has no trainable token left: past the bound, dropped
    assert row["loss_mask"] == [0, 0, 0, 0, 1, 1]
    assert row["versions"] == [-1, -1, 1, 1, 2, 3]  # versions stay as recorded
    assert (row["min_version"], row["staleness"]) == (1, 2)
    assert summary.masked_tokens == 2 + 2 and summary.dropped_stale == 1
    # Marked instead: kept, every token masked.
    rows, _ = _rows([(s, turns)], 3, max_staleness=1, mask_stale_tokens=True, stale="mark")
    assert rows[1]["stale"] is True and rows[1]["loss_mask"] == [0, 0, 0, 0]


def _group() -> list[tuple[Session, list[Interaction]]]:
    return [
        (_session("a"), [_turn("a", 0, [3])]),
        (_session("b", failure="engine_refusal"), [_turn("b", 0, [3])]),
        (_session("c"), [_turn("c", 0, [1])]),  # stale at version 3 with bound 1
        (_session("d"), [_turn("d", 0, [3])]),
    ]


def test_without_a_group_policy_failed_members_are_exported_and_named() -> None:
    rows, summary = _rows(_group(), 3)
    assert [r["session_id"] for r in rows] == ["a", "b", "c", "d"]
    assert [r["failure"] for r in rows] == ["", "engine_refusal", "", ""]
    assert summary.failed == [{"session_id": "b", "group_id": "g1", "failure": "engine_refusal"}]


def test_drop_incomplete_group_is_all_or_nothing() -> None:
    rows, summary = _rows(_group(), 3, drop_incomplete_group=True)
    assert rows == [] and summary.dropped_groups == 1 and summary.dropped_group_rows == 4
    whole = [m for m in _group() if not m[0].failure]
    rows, summary = _rows(whole, 3, drop_incomplete_group=True)
    assert len(rows) == 3 and summary.dropped_groups == 0
    # A member whose only row is dropped stale is not usable: the group goes.
    rows, summary = _rows(whole, 3, drop_incomplete_group=True, max_staleness=1)
    assert rows == [] and summary.dropped_stale == 1 and summary.dropped_groups == 1


def test_min_usable_group_size_exports_the_usable_members() -> None:
    # Usable at bound 1: a and d (b failed, c's row dropped stale).
    rows, summary = _rows(_group(), 3, max_staleness=1, min_usable_group_size=2)
    assert [r["session_id"] for r in rows] == ["a", "d"]
    assert summary.dropped_failed_rows == 1 and summary.dropped_stale == 1
    assert summary.exported == 2 and summary.dropped_groups == 0
    rows, summary = _rows(_group(), 3, max_staleness=1, min_usable_group_size=3)
    assert rows == [] and summary.dropped_groups == 1 and summary.dropped_group_rows == 3


def test_group_policies_apply_per_group() -> None:
    mixed = [
        (_session("a", "g1"), [_turn("a", 0, [3])]),
        (_session("b", "g1", failure="timeout"), [_turn("b", 0, [3])]),
        (_session("x", "g2"), [_turn("x", 0, [3])]),
        (_session("y", "g2"), [_turn("y", 0, [3])]),
    ]
    rows, summary = _rows(mixed, 3, drop_incomplete_group=True)
    assert [r["session_id"] for r in rows] == ["x", "y"]
    assert summary.dropped_groups == 1
    assert summary.to_json()["failed"] == [
        {"session_id": "b", "group_id": "g1", "failure": "timeout"}
    ]


@pytest.mark.parametrize(
    "policy",
    [
        {"max_staleness": -1},
        {"stale": "keep"},
        {"mask_stale_tokens": True},
        {"min_usable_group_size": -2},
        {"drop_incomplete_group": True, "min_usable_group_size": 2},
    ],
)
def test_bad_policies_are_refused(policy: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        Policy(**policy).check()


def _book(tmp_path: Any) -> SessionBook:
    return SessionBook(Store(tmp_path / "rec.db"), proxy_id="p1")


def _start(book: SessionBook, group: str, n: int) -> list[str]:
    ids = [new_id("sess") for _ in range(n)]
    book.start(group, "t", "m", [(sid, mint_key(sid)) for sid in ids])
    return ids


def test_a_failure_is_kept_with_the_session_and_reaches_its_rows(tmp_path: Any) -> None:
    book = _book(tmp_path)
    a, b = _start(book, "g1", 2)
    for sid in (a, b):
        book.store.add_interaction(_turn(sid, 0, [0]))
    assert book.end([b], "timeout") == 1
    # Ended already: a failure found later is still recorded, once; a clean end adds none.
    book.end([a])
    book.end([a], "client_error")
    book.end([a], "engine_refusal")
    assert book.store.session(a).failure == "client_error"
    assert book.store.session(b).failure == "timeout"
    sessions = book.resolve_export([], "g1")
    summary = Summary(0)
    rows = list(
        book.export_rows(
            sessions, "concat", 1.0, policy=Policy(min_usable_group_size=1), summary=summary
        )
    )
    assert rows == [] and summary.dropped_groups == 1
    assert {f["failure"] for f in summary.failed} == {"client_error", "timeout"}
    with pytest.raises(InvalidRequest):
        book.end([a], "Not A Code")


def test_a_database_from_before_failures_reads_sessions_as_not_failed(tmp_path: Any) -> None:
    path = tmp_path / "old.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE sessions DROP COLUMN failure")
    db.execute(
        "INSERT INTO sessions (session_id, group_id, task_id, key_hash, model, created_at, "
        "last_active_at) VALUES ('s-old', 'g', 't', 'h', 'm', 1.0, 1.0)"
    )
    db.commit()
    db.close()
    st = Store(path)
    assert st.session("s-old").failure == ""
    assert st.fail_sessions(["s-old"], "timeout") == 1
    assert st.session("s-old").failure == "timeout"
