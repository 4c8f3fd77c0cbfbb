"""Build the bundled tiny models offline: models/tiny-random and models/tiny-parrot.

    $(scripts/install-engine.sh) scripts/build_tiny_model.py

Needs torch, transformers and tokenizers (the SGLang engine venv has all
three), so the workspace and CI never need torch: the output is committed.

Both models share one tokenizer and one architecture (LlamaForCausalLM,
hidden 128, 2 layers, 2 heads, 1 KV head, head_dim 64, untied embeddings), so
a weight update from one checkpoint to the other swaps behaviour visibly.

The parrot's residual branches are zeroed, so the last hidden state is the
current token's (unit-norm) embedding; with lm_head = 2 x embeddings the
current token wins the argmax by a wide margin: greedy decoding repeats the
last prompt token, and a prompt ending in the end token stops at once.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "models"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 512

# ChatML, with tools rendered Hermes/Qwen style so tool-call parsing has a
# realistic prompt to work with.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{%- endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- elif message['content'] %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message.get('tool_calls') %}{%- for call in message['tool_calls'] %}"
    '\n<tool_call>{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{{ call['function']['arguments'] }}}</tool_call>{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def corpus(n: int = 4000) -> list[str]:
    rng = random.Random(0)
    words = (
        "the a an of to and in is it you that he was for on are with as I his they be at one "
        "have this from or had by hot word but what some we can out other were all there when "
        "up use your how said each she which do their time if will way about many then them "
        "write would like so these her long make thing see him two has look more day could go "
        "come did number sound no most people my over know water than call first who may down "
        "side been now find any new work part take get place made live where after back little "
        "only round man year came show every good me give our under name very through just form "
        "sentence great think say help low line differ turn cause much mean before move right "
        "boy old too same tell does set three want air well also play small end put home read "
        "hand port large spell add even land here must big high such follow act why ask men "
        "change went light kind off need house picture try us again animal point mother world "
        "user assistant system tool answer question hello hi please thanks weather city json "
        "name arguments function call result think reason step sum plus minus times equals"
    ).split()
    lines = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        elif kind < 0.8:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        else:
            lines.append('{"name": "get_weather", "arguments": {"city": "Paris"}} <think> </think>')
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    return fast


def config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )


def make_parrot(model: LlamaForCausalLM) -> None:
    with torch.no_grad():
        emb = torch.randn_like(model.model.embed_tokens.weight)
        emb /= emb.norm(dim=-1, keepdim=True)
        model.model.embed_tokens.weight.copy_(emb)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(2.0 * emb)


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, name: str) -> Path:
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 writes the template to its own file; keep a copy in the
    # tokenizer config too, where older readers (and areal-proxy) look first.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    # "TokenizersBackend" is a transformers-5 name; older loaders (vLLM's
    # transformers) know the fast tokenizer class, which reads the same file.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    # Likewise keep the pre-5 spelling of the RoPE settings beside the new one.
    model_cfg_path = out / "config.json"
    model_cfg = json.loads(model_cfg_path.read_text())
    model_cfg["rope_theta"] = model_cfg["rope_parameters"]["rope_theta"]
    model_cfg["torch_dtype"] = "float32"
    model_cfg_path.write_text(json.dumps(model_cfg, indent=2, sort_keys=True) + "\n")
    (out / "model.safetensors").chmod(0o644)
    return out


def check_parrot(path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    model = LlamaForCausalLM.from_pretrained(path)
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
    assert out == [ids[0, -1].item()] * 4, out
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = torch.tensor([[*ids[0].tolist(), end]])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
    assert out == [end], out


def main() -> None:
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    cfg = config(tokenizer)
    random_model = LlamaForCausalLM(cfg).eval()
    save(random_model, tokenizer, "tiny-random")
    torch.manual_seed(1)
    parrot = LlamaForCausalLM(cfg).eval()
    make_parrot(parrot)
    path = save(parrot, tokenizer, "tiny-parrot")
    check_parrot(path, tokenizer)
    n = sum(p.numel() for p in parrot.parameters())
    print(
        f"built models/tiny-random and models/tiny-parrot: {n} parameters, vocab {len(tokenizer)}"
    )


if __name__ == "__main__":
    main()
