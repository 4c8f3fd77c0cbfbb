"""The trainer process: holds the model and the optimizer, speaks JSON lines.

Run it with an interpreter that has torch + transformers (the SGLang engine's
venv has both); drivers start it through `examples.math.trainer_client`, so
torch never enters the workspace venv. This file imports nothing from the
workspace.

Protocol (one JSON object per line; stdout carries only protocol lines,
everything else -- warnings, prints -- goes to stderr):

    <- {"event": "ready", "pid": 123, "torch": "2.14.1"}          (once, at start)
    -> {"id": 1, "cmd": "init", "model_path": "...", ...}
    <- {"id": 1, "ok": true, "result": {...}}
    <- {"id": 2, "ok": false, "error": "one line"}                  (on failure)

Commands (`result` fields in brackets):

- init {model_path, seed, num_threads, dtype, optimizer: {type, lr, weight_decay,
  beta1, beta2, eps, gradient_clipping, lr_scheduler_type, warmup_steps},
  total_steps, ref_model: bool}  [n_params, vocab_size, eos_token_id, pad_token_id]
- encode_chat {items: [{messages, answer?}]}  [rows: [{input_ids, loss_mask}]]
  the prompt rendered with the model's chat template (generation prompt added);
  with `answer`, its tokens + the end token are appended with loss_mask 1 --
  the same layout as a row exported by the RL API.
- sft_step {rows: [{input_ids, loss_mask}], n_minibatches}
  [loss, grad_norm, lr, n_tokens]: one optimizer step of token-mean cross-entropy
  on the loss_mask == 1 tokens.
- ppo_step {rows: [{input_ids, loss_mask, logprobs, advantage}], eps_clip, kl_coef,
  temperature, ppo_epochs, n_minibatches}
  [loss, grad_norm, lr, n_tokens, clip_frac, ratio_mean, ratio_max, approx_kl,
  kl_ref, entropy]: PPO-clipped policy gradient against the rows' behaviour
  logprobs (the engine's), token-mean over loss_mask == 1; one optimizer step per
  minibatch per epoch; the LR schedule advances once per call.
- eval_loss {rows}  [loss, n_tokens]  (no update)
- logprobs {rows, temperature}  [logprobs: per row, 0.0 where loss_mask == 0]
- generate {prompts: [[ids]], max_new_tokens, temperature, seed}
  [outputs: [{output_ids, logprobs}]]: sampling inside the trainer (temperature 0 =
  greedy), for evaluation, tests and offline checks (GRPO rolls out through an
  inference service).
- decode {ids: [[ids]]}  [texts] (special tokens skipped)
- save {path}  [path]: a HF checkpoint folder (written beside, then renamed in),
  tokenizer and config files copied from the model folder.
- shutdown  []: exits 0 after answering.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# The protocol owns the real stdout; anything printed by libraries goes to stderr.
_PROTO = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
sys.stdout = sys.stderr

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
COMMANDS = (
    "init",
    "encode_chat",
    "sft_step",
    "ppo_step",
    "eval_loss",
    "logprobs",
    "generate",
    "decode",
    "save",
)


class Trainer:
    def __init__(self) -> None:
        self.model: Any = None
        self.ref: Any = None
        self.tokenizer: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.model_path = ""
        self.grad_clip = 0.0

    # ------------------------------------------------------------------ setup

    def init(
        self,
        model_path: str,
        seed: int = 1,
        num_threads: int = 0,
        dtype: str = "float32",
        optimizer: dict[str, Any] | None = None,
        total_steps: int = 1,
        ref_model: bool = False,
    ) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.model_path = model_path
        torch_dtype = getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self.model.train()
        if ref_model:
            self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).eval()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        opt = dict(optimizer or {})
        lr = float(opt.get("lr", 1e-3))
        kind = opt.get("type", "adamw")
        params = [p for p in self.model.parameters() if p.requires_grad]
        if kind == "sgd":
            self.optimizer = torch.optim.SGD(
                params, lr=lr, weight_decay=opt.get("weight_decay", 0.0)
            )
        else:
            cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
            self.optimizer = cls(
                params,
                lr=lr,
                betas=(opt.get("beta1", 0.9), opt.get("beta2", 0.999)),
                eps=opt.get("eps", 1e-8),
                weight_decay=opt.get("weight_decay", 0.0),
            )
        self.grad_clip = float(opt.get("gradient_clipping", 0.0))
        warmup = int(opt.get("warmup_steps", 0))
        schedule = opt.get("lr_scheduler_type", "constant")
        total = max(1, int(total_steps))

        def factor(step: int) -> float:
            if warmup and step < warmup:
                return (step + 1) / (warmup + 1)
            if schedule == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            if schedule == "linear":
                return max(0.0, 1.0 - progress)
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        n_params = sum(p.numel() for p in self.model.parameters())
        return {
            "n_params": n_params,
            "vocab_size": self.model.config.vocab_size,
            "eos_token_id": self.tokenizer.eos_token_id,
            "pad_token_id": self.tokenizer.pad_token_id,
            "threads": torch.get_num_threads(),
        }

    def _need(self) -> None:
        if self.model is None:
            raise RuntimeError("call init first")

    # ------------------------------------------------------------------ data

    def encode_chat(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        self._need()
        rows = []
        for item in items:
            prompt = self.tokenizer.apply_chat_template(
                item["messages"], add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer(prompt, add_special_tokens=False).input_ids
            mask = [0] * len(ids)
            if item.get("answer") is not None:
                out = self.tokenizer(item["answer"], add_special_tokens=False).input_ids
                out.append(self.tokenizer.eos_token_id)
                ids = ids + out
                mask = mask + [1] * len(out)
            rows.append({"input_ids": ids, "loss_mask": mask})
        return {"rows": rows}

    def _batch(self, rows: list[dict[str, Any]], *keys: str) -> dict[str, torch.Tensor]:
        n = max(len(r["input_ids"]) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        out: dict[str, torch.Tensor] = {}
        ids = torch.full((len(rows), n), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), n), dtype=torch.long)
        mask = torch.zeros((len(rows), n), dtype=torch.float32)
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            if len(r["loss_mask"]) != k:
                raise ValueError(f"row {i}: loss_mask has {len(r['loss_mask'])} items, not {k}")
            ids[i, :k] = torch.tensor(r["input_ids"])
            attn[i, :k] = 1
            mask[i, :k] = torch.tensor(r["loss_mask"], dtype=torch.float32)
        out.update(input_ids=ids, attention_mask=attn, loss_mask=mask)
        if "logprobs" in keys:
            lp = torch.zeros((len(rows), n), dtype=torch.float32)
            for i, r in enumerate(rows):
                if len(r["logprobs"]) != len(r["input_ids"]):
                    raise ValueError(f"row {i}: logprobs and input_ids differ in length")
                lp[i, : len(r["logprobs"])] = torch.tensor(r["logprobs"], dtype=torch.float32)
            out["logprobs"] = lp
        if "advantage" in keys:
            out["advantage"] = torch.tensor([float(r["advantage"]) for r in rows])
        return out

    def _token_logprobs(
        self, model: Any, batch: dict[str, torch.Tensor], temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob of each next token, entropy), both [B, T-1], aligned to input_ids[:, 1:]."""
        logits = (
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            .logits[:, :-1]
            .float()
        )
        if temperature != 1.0:
            logits = logits / temperature
        logp = F.log_softmax(logits, dim=-1)
        target = batch["input_ids"][:, 1:].unsqueeze(-1)
        token_lp = logp.gather(-1, target).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return token_lp, entropy

    # ------------------------------------------------------------------ steps

    def _optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(
            params, self.grad_clip if self.grad_clip > 0 else float("inf")
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def sft_step(self, rows: list[dict[str, Any]], n_minibatches: int = 1) -> dict[str, Any]:
        self._need()
        self.model.train()
        total_tokens = sum(sum(r["loss_mask"][1:]) for r in rows)
        if total_tokens == 0:
            raise ValueError("no trainable tokens (loss_mask is all 0)")
        loss_sum = 0.0
        for mb in _split(rows, n_minibatches):
            batch = self._batch(mb)
            token_lp, _ = self._token_logprobs(self.model, batch)
            mask = batch["loss_mask"][:, 1:]
            loss = -(token_lp * mask).sum() / total_tokens
            loss.backward()
            loss_sum += float(loss)
        norm = self._optimizer_step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {"loss": loss_sum, "grad_norm": norm, "lr": lr, "n_tokens": int(total_tokens)}

    @torch.no_grad()
    def eval_loss(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        self._need()
        self.model.eval()
        batch = self._batch(rows)
        token_lp, _ = self._token_logprobs(self.model, batch)
        mask = batch["loss_mask"][:, 1:]
        n = float(mask.sum())
        self.model.train()
        return {"loss": float(-(token_lp * mask).sum() / max(n, 1.0)), "n_tokens": int(n)}

    def ppo_step(
        self,
        rows: list[dict[str, Any]],
        eps_clip: float = 0.2,
        kl_coef: float = 0.0,
        temperature: float = 1.0,
        ppo_epochs: int = 1,
        n_minibatches: int = 1,
        decoupled: bool = False,
        behav_imp_weight_cap: float = 5.0,
    ) -> dict[str, Any]:
        """A PPO-clipped policy-gradient step. `decoupled`: the decoupled objective of
        asynchronous RL, for rows sampled by older weights: the clipped ratio is taken
        against a proximal policy (this model before the step, recomputed here) rather than
        the behaviour policy that sampled the tokens (the recorded `logprobs`), and each
        token's loss is weighted by the behaviour importance weight pi_prox / pi_behav,
        clipped at `behav_imp_weight_cap`, so that stale samples are corrected, not ignored.
        With fresh rows (behaviour = proximal) it is plain PPO."""
        self._need()
        if kl_coef > 0 and self.ref is None:
            raise ValueError("kl_coef > 0 needs init(ref_model=true)")
        if decoupled:
            # The proximal policy: the weights every minibatch of this step starts from.
            prox = self.logprobs(rows, temperature)["logprobs"]
            rows = [{**r, "prox_logprobs": p} for r, p in zip(rows, prox, strict=True)]
        self.model.train()
        stats: dict[str, float] = {
            "loss": 0.0,
            "clip_frac": 0.0,
            "ratio_mean": 0.0,
            "ratio_max": 0.0,
            "approx_kl": 0.0,
            "kl_ref": 0.0,
            "entropy": 0.0,
            "behav_weight_mean": 0.0,
            "behav_weight_clipped": 0.0,
        }
        norms: list[float] = []
        n_updates = 0
        n_tokens = 0
        for _ in range(ppo_epochs):
            for mb in _split(rows, n_minibatches):
                batch = self._batch(mb, "logprobs", "advantage")
                new_lp, entropy = self._token_logprobs(self.model, batch, temperature)
                mask = batch["loss_mask"][:, 1:]
                n = mask.sum().clamp(min=1.0)
                old_lp = batch["logprobs"][:, 1:]
                weight = torch.ones_like(mask)
                if decoupled:
                    behav_lp = old_lp
                    old_lp = _padded([r["prox_logprobs"] for r in mb], mask.shape[1] + 1)[:, 1:]
                    raw = torch.exp((old_lp - behav_lp) * mask)
                    weight = raw.clamp(max=behav_imp_weight_cap)
                    with torch.no_grad():
                        stats["behav_weight_mean"] += float((raw * mask).sum() / n)
                        over = (raw > behav_imp_weight_cap).float() * mask
                        stats["behav_weight_clipped"] += float(over.sum() / n)
                adv = batch["advantage"].unsqueeze(1)
                log_ratio = (new_lp - old_lp) * mask
                ratio = torch.exp(log_ratio)
                surr1 = ratio * adv
                surr2 = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv
                pg = -torch.min(surr1, surr2) * weight
                loss = (pg * mask).sum() / n
                kl_ref = torch.zeros(())
                if kl_coef > 0:
                    with torch.no_grad():
                        ref_lp, _ = self._token_logprobs(self.ref, batch, temperature)
                    d = (ref_lp - new_lp) * mask
                    kl_ref = ((torch.exp(d) - d - 1.0) * mask).sum() / n
                    loss = loss + kl_coef * kl_ref
                loss.backward()
                norms.append(self._optimizer_step())
                with torch.no_grad():
                    clipped = ((ratio - 1.0).abs() > eps_clip).float() * mask
                    stats["loss"] += float(loss)
                    stats["clip_frac"] += float(clipped.sum() / n)
                    stats["ratio_mean"] += float((ratio * mask).sum() / n)
                    stats["ratio_max"] = max(stats["ratio_max"], float((ratio * mask).max()))
                    stats["approx_kl"] += float(((ratio - 1.0 - log_ratio) * mask).sum() / n)
                    stats["kl_ref"] += float(kl_ref)
                    stats["entropy"] += float((entropy * mask).sum() / n)
                n_updates += 1
                n_tokens += int(mask.sum())
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        for k in (
            "loss",
            "clip_frac",
            "ratio_mean",
            "approx_kl",
            "kl_ref",
            "entropy",
            "behav_weight_mean",
            "behav_weight_clipped",
        ):
            stats[k] /= max(1, n_updates)
        return {
            **stats,
            "grad_norm": sum(norms) / max(1, len(norms)),
            "lr": lr,
            "n_tokens": n_tokens // max(1, ppo_epochs),
            "n_updates": n_updates,
        }

    @torch.no_grad()
    def logprobs(self, rows: list[dict[str, Any]], temperature: float = 1.0) -> dict[str, Any]:
        self._need()
        self.model.eval()
        batch = self._batch(rows)
        token_lp, _ = self._token_logprobs(self.model, batch, temperature)
        self.model.train()
        out = []
        for i, r in enumerate(rows):
            k = len(r["input_ids"])
            lp = [0.0, *token_lp[i, : k - 1].tolist()]
            out.append([v if m else 0.0 for v, m in zip(lp, r["loss_mask"], strict=True)])
        return {"logprobs": out}

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> dict[str, Any]:
        self._need()
        self.model.eval()
        gen = torch.Generator().manual_seed(seed)
        eos = self.tokenizer.eos_token_id
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out_ids: list[int] = []
            lps: list[float] = []
            past = None
            step_ids = ids
            for _ in range(max_new_tokens):
                res = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
                past = res.past_key_values
                logits = res.logits[0, -1].float()
                if temperature > 0:
                    logp = F.log_softmax(logits / temperature, dim=-1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                else:
                    logp = F.log_softmax(logits, dim=-1)
                    tok = int(logp.argmax())
                out_ids.append(tok)
                lps.append(float(logp[tok]))
                if tok == eos:
                    break
                step_ids = torch.tensor([[tok]])
            outputs.append({"output_ids": out_ids, "logprobs": lps})
        self.model.train()
        return {"outputs": outputs}

    def decode(self, ids: list[list[int]]) -> dict[str, Any]:
        self._need()
        return {"texts": [self.tokenizer.decode(x, skip_special_tokens=True) for x in ids]}

    def save(self, path: str) -> dict[str, Any]:
        self._need()
        out = Path(path)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        src = Path(self.model_path)
        for f in src.iterdir():
            # Tokenizer files and the model config exactly as the model folder has them.
            if f.is_file() and f.name not in WEIGHT_FILES:
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return {"path": str(out)}


def _padded(values: list[list[float]], n: int) -> torch.Tensor:
    """Per-token lists as one [rows, n] tensor, zero-padded on the right."""
    out = torch.zeros((len(values), n), dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def _split(rows: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    n = max(1, min(n, len(rows)))
    size = math.ceil(len(rows) / n)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _send(obj: dict[str, Any]) -> None:
    _PROTO.write(json.dumps(obj, separators=(",", ":")) + "\n")
    _PROTO.flush()


def main() -> int:
    trainer = Trainer()
    _send({"event": "ready", "pid": os.getpid(), "torch": torch.__version__})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req_id: Any = None
        try:
            req = json.loads(line)
            req_id = req.pop("id", None)
            cmd = req.pop("cmd")
            if cmd == "shutdown":
                _send({"id": req_id, "ok": True, "result": {}})
                return 0
            if cmd not in COMMANDS:
                raise ValueError(f"unknown command {cmd!r}")
            t0 = time.perf_counter()
            result = getattr(trainer, cmd)(**req)
            result["seconds"] = round(time.perf_counter() - t0, 4)
            _send({"id": req_id, "ok": True, "result": result})
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            msg = " ".join(f"{type(e).__name__}: {e}".split())
            _send({"id": req_id, "ok": False, "error": msg})
    return 0


if __name__ == "__main__":
    sys.exit(main())
