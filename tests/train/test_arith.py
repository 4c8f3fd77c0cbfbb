"""The arithmetic task of the SmolLM2 GRPO example: splits and the exact-answer reward."""

from __future__ import annotations

import pytest

from examples.math import arith


def test_split_is_disjoint_deterministic_and_complete():
    train, held = arith.make_split(3, min_operand=10, max_operand=99, n_eval=64)
    assert len(held) == 64 and len(train) == 90 * 90 - 64
    key = lambda p: (p.a, p.b, p.op)  # noqa: E731
    assert not {key(p) for p in train} & {key(p) for p in held}
    again_train, again_held = arith.make_split(3, min_operand=10, max_operand=99, n_eval=64)
    assert [key(p) for p in again_held] == [key(p) for p in held]
    assert [key(p) for p in again_train] == [key(p) for p in train]
    other = arith.make_split(4, min_operand=10, max_operand=99, n_eval=64)[1]
    assert [key(p) for p in other] != [key(p) for p in held]
    assert len(arith.make_split(3, n_train=100, n_eval=8)[0]) == 100


def test_problem_text_answer_and_messages():
    p = arith.Problem("t-0", 37, 48, "+")
    assert p.question == "What is 37 + 48?" and p.answer == 85
    assert p.messages() == [{"role": "user", "content": "What is 37 + 48?"}]
    i = arith.Problem("t-3", 3, 4, "+", instruction="Answer with a number.")
    assert i.question == "What is 3 + 4? Answer with a number."
    s = arith.Problem("t-1", 20, 35, "-", system="Answer with the number only.")
    assert s.answer == -15
    assert s.messages()[0] == {"role": "system", "content": "Answer with the number only."}
    assert arith.Problem("t-2", 12, 11, "*").answer == 132


@pytest.mark.parametrize(
    ("text", "reward", "alone"),
    [
        ("85", 1.0, True),
        (" 85.\n", 1.0, True),
        ("85.", 1.0, True),
        ("84", 0.0, False),
        ("The answer is 85.", 1.0, False),  # the right number, in a sentence
        ("37 + 48 = 85", 1.0, False),
        ("37 + 48 = 86", 0.0, False),  # the last number counts, not any number
        ("85 or 86", 0.0, False),
        ("To add 37 and 48, we", 0.0, False),  # cut off before its answer
        ("", 0.0, False),
        ("eighty-five", 0.0, False),
        ("1,085", 0.0, False),
    ],
)
def test_exact_answer_reward_and_strict_check(text, reward, alone):
    assert arith.reward(text, 85) == reward
    assert arith.strict_correct(text, 85) is alone


def test_bad_task_settings_are_refused():
    with pytest.raises(ValueError, match="ops must be made of"):
        arith.make_split(1, ops="/")
    with pytest.raises(ValueError, match="min_operand 9 > max_operand 3"):
        arith.make_split(1, min_operand=9, max_operand=3)
    with pytest.raises(ValueError, match="leaves no training problem"):
        arith.make_split(1, min_operand=1, max_operand=2, n_eval=4)
