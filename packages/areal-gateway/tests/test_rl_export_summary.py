"""The export summary of an export spread over several proxies: one, summed (rl.py)."""

from __future__ import annotations

import orjson

from areal_gateway.rl import merged_summary
from areal_gateway.schemas import ExportRequest, ExportSummary


def _part(version: int, exported: int, staleness: dict[str, int], failed: list) -> bytes:
    return orjson.dumps(
        {
            "version": version,
            "exported": exported,
            "marked_stale": 0,
            "dropped_stale": 1,
            "masked_tokens": 2,
            "dropped_groups": 0,
            "dropped_group_rows": 0,
            "dropped_failed_rows": 0,
            "failed": failed,
            "staleness": staleness,
        }
    )


def test_summaries_of_several_proxies_add_up() -> None:
    f = {"session_id": "s2", "group_id": "g", "failure": "timeout"}
    out = merged_summary([_part(3, 2, {"0": 1, "10": 1}, []), _part(4, 3, {"1": 2, "0": 1}, [f])])
    assert out["version"] == 4 and out["exported"] == 5
    assert (out["dropped_stale"], out["masked_tokens"]) == (2, 4)
    assert out["failed"] == [f]
    # Counts by staleness, summed, in numeric order.
    assert list(out["staleness"].items()) == [("0", 2), ("1", 2), ("10", 1)]
    ExportSummary.model_validate(out)


def test_new_export_options_default_to_every_row() -> None:
    body = ExportRequest.model_validate({"group_id": "g"})
    assert body.max_staleness is None and body.stale == "drop"
    assert not body.mask_stale_tokens and not body.drop_incomplete_group
    assert body.min_usable_group_size == 0
