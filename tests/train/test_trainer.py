"""The trainer process on synthetic rows in the RL API's exported format."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from areal_train.advantages import group_advantages
from examples.math import data
from examples.math.trainer_client import TrainerClient, TrainerError

TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-random"


def exported_rows(trainer: TrainerClient, problems: list[data.Problem], group: int, seed: int):
    """Sample in the trainer and lay the samples out exactly as export.py does."""
    prompts = trainer.call("encode_chat", items=[{"messages": p.messages()} for p in problems])
    ids = [r["input_ids"] for r in prompts["rows"]]
    flat = [x for x in ids for _ in range(group)]
    outs = trainer.call("generate", prompts=flat, max_new_tokens=2, temperature=1.0, seed=seed)
    texts = trainer.call("decode", ids=[o["output_ids"] for o in outs["outputs"]])["texts"]
    rows = []
    for k, (prompt, out, text) in enumerate(zip(flat, outs["outputs"], texts, strict=True)):
        p = problems[k // group]
        n, m = len(prompt), len(out["output_ids"])
        rows.append(
            {
                "session_id": f"s{k}",
                "group_id": f"g-{p.task_id}",
                "task_id": p.task_id,
                "interaction_id": f"i{k}",
                "reward": data.reward(text, p.answer),
                "finish_reason": "stop",
                "input_ids": prompt + out["output_ids"],
                "loss_mask": [0] * n + [1] * m,
                "logprobs": [0.0] * n + out["logprobs"],
                "versions": [-1] * n + [0] * m,
                "interaction_ids": [f"i{k}"],
            }
        )
    return rows


def test_ready_line_and_info(trainer: TrainerClient) -> None:
    assert trainer.info["event"] == "ready"
    assert trainer.info["vocab_size"] == 512
    assert trainer.info["n_params"] > 400_000


def test_encode_chat_matches_exported_layout(trainer: TrainerClient) -> None:
    p = data.Problem("t", 3, 4)
    row = trainer.call("encode_chat", items=[{"messages": p.messages(), "answer": "7"}])["rows"][0]
    eos = trainer.info["eos_token_id"]
    assert row["input_ids"][-1] == eos
    assert row["loss_mask"][-2:] == [1, 1] and sum(row["loss_mask"]) == 2
    assert trainer.call("decode", ids=[row["input_ids"][-2:]])["texts"] == ["7"]


def test_behaviour_logprobs_give_ratio_one(trainer: TrainerClient) -> None:
    problems = data.make_dataset(1)[:4]
    rows = exported_rows(trainer, problems, group=4, seed=1)
    # The trainer's own logprobs of the sampled tokens equal the sampler's.
    lps = trainer.call("logprobs", rows=rows)["logprobs"]
    for row, lp in zip(rows, lps, strict=True):
        for a, b, m in zip(row["logprobs"], lp, row["loss_mask"], strict=True):
            if m:
                assert a == pytest.approx(b, abs=1e-4)
    for i, r in enumerate(rows):
        r["reward"] = float(i % 2)  # the random model rarely scores: give each group a spread
    for r, a in zip(rows, group_advantages(rows), strict=True):
        r["advantage"] = a
    assert {round(r["advantage"], 3) for r in rows} == {-1.0, 1.0}
    stats = trainer.call("ppo_step", rows=rows, eps_clip=0.2, kl_coef=0.1)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert stats["clip_frac"] == 0.0
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # still the initial weights
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert stats["n_tokens"] == sum(sum(r["loss_mask"]) for r in rows)


def test_positive_advantage_raises_its_logprob(trainer: TrainerClient) -> None:
    problems = data.make_dataset(2)[:1]
    rows = exported_rows(trainer, problems, group=2, seed=2)
    rows[0]["advantage"], rows[1]["advantage"] = 1.0, -1.0
    before = trainer.call("logprobs", rows=rows)["logprobs"]
    for r, lp in zip(rows, before, strict=True):
        r["logprobs"] = lp  # behaviour = current policy
    for _ in range(3):
        stats = trainer.call("ppo_step", rows=rows, eps_clip=0.2, kl_coef=0.01)
        for r, lp in zip(rows, trainer.call("logprobs", rows=rows)["logprobs"], strict=True):
            r["logprobs"] = lp
    after = trainer.call("logprobs", rows=rows)["logprobs"]
    assert sum(after[0]) > sum(before[0])
    assert sum(after[1]) < sum(before[1])
    assert stats["kl_ref"] > 0


def test_decoupled_step_weights_stale_tokens_by_the_clipped_behaviour_ratio(
    trainer: TrainerClient,
) -> None:
    """The decoupled objective: the clipped ratio against the proximal policy (the weights
    before the step, recomputed), each token weighted by pi_prox / pi_behav, capped."""
    problems = data.make_dataset(4)[:1]
    rows = exported_rows(trainer, problems, group=2, seed=4)
    rows[0]["advantage"], rows[1]["advantage"] = 1.0, -1.0
    current = trainer.call("logprobs", rows=rows)["logprobs"]
    # Fresh rows (behaviour = the current policy): every weight 1, the ratio 1, as plain PPO.
    for r, lp in zip(rows, current, strict=True):
        r["logprobs"] = lp
    fresh = trainer.call("ppo_step", rows=rows, decoupled=True, behav_imp_weight_cap=5.0)
    assert fresh["behav_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert fresh["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert fresh["behav_weight_clipped"] == 0.0
    # Stale rows: the behaviour policy gave its tokens 1 nat less than the proximal one does
    # (weight e ~ 2.72 each, under the cap), then 3 nats less (weight e^3 ~ 20, capped at 5).
    current = trainer.call("logprobs", rows=rows)["logprobs"]
    for shift, clipped in ((1.0, 0.0), (3.0, 1.0)):
        for r, lp in zip(rows, current, strict=True):
            r["logprobs"] = [
                v - shift if m else 0.0 for v, m in zip(lp, r["loss_mask"], strict=True)
            ]
        stats = trainer.call(
            "ppo_step", rows=rows, decoupled=True, behav_imp_weight_cap=5.0, eps_clip=1e9
        )
        assert stats["behav_weight_mean"] == pytest.approx(math.exp(shift), rel=1e-3)
        assert stats["behav_weight_clipped"] == pytest.approx(clipped)
        # The ratio is against the proximal policy, not the (much older) behaviour one.
        assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        current = trainer.call("logprobs", rows=rows)["logprobs"]


def test_sft_step_lowers_loss(trainer: TrainerClient) -> None:
    problems = data.make_dataset(3)[:8]
    items = [{"messages": p.messages(), "answer": str(p.answer)} for p in problems]
    rows = trainer.call("encode_chat", items=items)["rows"]
    first = trainer.call("eval_loss", rows=rows)["loss"]
    for _ in range(5):
        trainer.call("sft_step", rows=rows)
    assert trainer.call("eval_loss", rows=rows)["loss"] < first


def test_save_writes_loadable_checkpoint(trainer: TrainerClient, tmp_path: Path) -> None:
    out = trainer.call("save", path=str(tmp_path / "ckpt"))["path"]
    files = {p.name for p in Path(out).iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert json.loads((Path(out) / "config.json").read_text()) == json.loads(
        (TINY / "config.json").read_text()
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_errors_are_one_line_and_process_survives(trainer: TrainerClient) -> None:
    with pytest.raises(TrainerError, match=r"trainer 'nope' failed: ValueError: unknown command"):
        trainer.call("nope")
    with pytest.raises(TrainerError, match="loss_mask has 3 items, not 2"):
        trainer.call("sft_step", rows=[{"input_ids": [1, 2], "loss_mask": [0, 1, 1]}])
    assert trainer.call("decode", ids=[[25]])["texts"] == ["7"]
