"""A small arithmetic dataset and its rule-based reward (stdlib only).

The bundled tiny model (0.4 M parameters, random weights) cannot do GSM8K, so
the examples train on the smallest math the tokenizer knows: "What is a + b?
The answer is" with single-digit operands and a single-digit sum, so the
answer is one token ("0" .. "9"). Generated deterministically from a seed.

Reward (rule-based, on the completion's leading number n; the sum is s):
- 1.0                                   n == s (exact match);
- 0.1 + 0.4 * max(0, 1 - |n - s| / 5)   another number: format credit plus
  closeness, so a random model's groups are not all zero and, within a group,
  nearer answers beat farther ones (pure exact-match collapsed onto one wrong
  digit in measurements: every group equal, no signal left);
- 0.0                                   no leading number.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

PROMPT = "What is {a} + {b}? The answer is"
_LEADING_NUMBER = re.compile(r"^\s*(-?\d+)")

CORRECT = 1.0
FORMAT = 0.1
CLOSENESS = 0.4


@dataclass(frozen=True)
class Problem:
    task_id: str
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return PROMPT.format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a + self.b

    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.prompt}]


def make_dataset(seed: int, size: int = 0, max_operand: int = 9, max_sum: int = 9) -> list[Problem]:
    """Every (a, b) with a, b <= max_operand and a + b <= max_sum, shuffled by seed.

    `size` > 0 keeps the first `size` (repeating the set when it is larger).
    """
    pairs = [
        (a, b) for a in range(max_operand + 1) for b in range(max_operand + 1) if a + b <= max_sum
    ]
    if not pairs:
        raise ValueError("no problems: max_operand/max_sum leave nothing")
    random.Random(seed).shuffle(pairs)
    if size > 0:
        pairs = [pairs[i % len(pairs)] for i in range(size)]
    return [Problem(f"add-{a}-{b}-{i}", a, b) for i, (a, b) in enumerate(pairs)]


def reward(completion: str, answer: int) -> float:
    m = _LEADING_NUMBER.match(completion)
    if m is None:
        return 0.0
    n = int(m.group(1))
    if n == answer:
        return CORRECT
    return FORMAT + CLOSENESS * max(0.0, 1.0 - abs(n - answer) / 5)


def batches(
    dataset: list[Problem], batch_size: int, *, seed: int, epoch: int, shuffle: bool = True
) -> list[list[Problem]]:
    """The epoch's batches (the last, smaller one dropped when there is more than one)."""
    order = list(dataset)
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    out = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if len(out) > 1 and len(out[-1]) < batch_size:
        out.pop()
    return out
