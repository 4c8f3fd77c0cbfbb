"""Small arithmetic with checkable answers, for an instruct model (stdlib only).

Problems "What is a + b? Answer with a number." (or -, *) with operands drawn from
[min_operand, max_operand], every pair at most once, split by seed into a held-out set and a
training set that share no problem.

Reward (exact answer, no partial credit): 1.0 when the last number in the completion is the
answer ("3 + 4 = 7", "7", "The answer is 7."), else 0.0 -- a wrong number, no number, or an
answer cut off before its number all score 0. `strict_correct` (the completion is the number
alone, a final period allowed) is reported beside it, to show how much of a change is format.
"""

from __future__ import annotations

import operator
import random
import re
from dataclasses import dataclass
from typing import Any

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_EXACT = re.compile(r"^\s*(-?\d+)\s*\.?\s*$")
_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    task_id: str
    a: int
    b: int
    op: str
    system: str = ""
    instruction: str = ""

    @property
    def question(self) -> str:
        q = f"What is {self.a} {self.op} {self.b}?"
        return f"{q} {self.instruction}" if self.instruction else q

    @property
    def answer(self) -> int:
        return int(OPS[self.op](self.a, self.b))

    def messages(self) -> list[dict[str, Any]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return [*msgs, {"role": "user", "content": self.question}]


def make_split(
    seed: int,
    *,
    ops: str = "+",
    min_operand: int = 10,
    max_operand: int = 99,
    n_train: int = 0,
    n_eval: int = 64,
    system: str = "",
    instruction: str = "",
) -> tuple[list[Problem], list[Problem]]:
    """(train, held_out): disjoint, shuffled by seed; n_train 0 = every problem not held out."""
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"ops must be made of {''.join(OPS)}, not {ops!r}")
    if min_operand > max_operand:
        raise ValueError(f"min_operand {min_operand} > max_operand {max_operand}")
    if n_eval < 0 or n_train < 0:
        raise ValueError("n_train and n_eval must not be negative")
    span = range(min_operand, max_operand + 1)
    triples = [(a, b, op) for op in ops for a in span for b in span]
    random.Random(seed).shuffle(triples)
    if n_eval >= len(triples):
        raise ValueError(f"n_eval {n_eval} leaves no training problem (there are {len(triples)})")
    held = triples[:n_eval]
    rest = triples[n_eval:]
    if n_train:
        rest = rest[:n_train]

    def build(items: list[tuple[int, int, str]], prefix: str) -> list[Problem]:
        return [
            Problem(f"{prefix}-{i}", a, b, op, system, instruction)
            for i, (a, b, op) in enumerate(items)
        ]

    return build(rest, "train"), build(held, "eval")


def reward(completion: str, answer: int) -> float:
    """The exact-answer reward: 1.0 when the last number in the completion is the answer."""
    numbers = _NUMBER.findall(completion.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


def strict_correct(completion: str, answer: int) -> bool:
    """The completion is the answer alone (a final period allowed)."""
    m = _EXACT.match(completion.replace(",", ""))
    return m is not None and int(m.group(1)) == answer
