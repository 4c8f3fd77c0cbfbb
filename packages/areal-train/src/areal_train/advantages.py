"""Group-normalised advantages for GRPO (stdlib only).

For each group (the samples of one prompt), `A_i = (r_i - mean(r)) / (std(r) + eps)`
(population std; without std normalisation only the mean is removed). A group whose
rewards are all equal gets 0 for every member: it carries no signal.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any


def normalise_group(
    rewards: Sequence[float], std_normalize: bool = True, eps: float = 1e-6
) -> list[float]:
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not std_normalize:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    if std < eps:
        return [0.0] * len(centred)
    return [c / (std + eps) for c in centred]


def group_advantages(
    rows: Sequence[dict[str, Any]],
    *,
    group_key: str = "group_id",
    reward_key: str = "reward",
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """One advantage per row, normalised within rows that share `group_key`.

    Rows without a reward count as 0.
    """
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        groups[row.get(group_key)].append(i)
    out = [0.0] * len(rows)
    for members in groups.values():
        rewards = [float(rows[i].get(reward_key) or 0.0) for i in members]
        for i, a in zip(members, normalise_group(rewards, std_normalize, eps), strict=True):
            out[i] = a
    return out
