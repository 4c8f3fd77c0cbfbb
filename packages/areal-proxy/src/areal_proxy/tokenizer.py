"""The model's tokenizer without transformers: files read once, encode/decode, token bytes,
stop ids, and an incremental detokenizer for real token-by-token streams."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    """The printable-character alphabet of byte-level BPE, back to bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


@dataclass
class ModelTokenizer:
    """Everything the proxy needs from a model folder, loaded once at start."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    context_length: int
    special_ids: frozenset[int]
    _byte_level: bool = False
    _byte_fallback: bool = False
    _bytes_cache: dict[int, bytes] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelTokenizer:
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        tok_json = orjson.loads(tok_file.read_bytes())
        tokenizer = Tokenizer.from_file(str(tok_file))
        tcfg = _read_json(root / "tokenizer_config.json")
        gcfg = _read_json(root / "generation_config.json")
        mcfg = _read_json(root / "config.json")

        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = root / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text()

        bos = _token_content(tcfg.get("bos_token"))
        eos = _token_content(tcfg.get("eos_token"))
        eos_ids: list[int] = []
        if eos is not None and (tid := tokenizer.token_to_id(eos)) is not None:
            eos_ids.append(tid)
        for src in (gcfg.get("eos_token_id"), mcfg.get("eos_token_id")):
            for tid in _ids(src):
                if tid not in eos_ids:
                    eos_ids.append(tid)

        ctx = mcfg.get("max_position_embeddings")
        if not isinstance(ctx, int):
            text_cfg = mcfg.get("text_config")
            ctx = text_cfg.get("max_position_embeddings") if isinstance(text_cfg, dict) else None
        special = frozenset(
            int(t["id"]) for t in tok_json.get("added_tokens", []) if t.get("special")
        )
        decoder = tok_json.get("decoder") or {}
        decoders = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {d.get("type") for d in decoders if isinstance(d, dict)}
        return cls(
            tokenizer=tokenizer,
            chat_template=template if isinstance(template, str) else None,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            context_length=ctx if isinstance(ctx, int) and ctx > 0 else 0,
            special_ids=special,
            _byte_level="ByteLevel" in kinds,
            _byte_fallback="ByteFallback" in kinds,
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (a part of a UTF-8 character, maybe)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            out = b""
        elif token_id in self.special_ids:
            out = piece.encode()
        elif self._byte_level:
            table = _BYTE_DECODER
            out = (
                bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
            )
        elif self._byte_fallback and (m := _BYTE_FALLBACK.match(piece)):
            out = bytes([int(m.group(1), 16)])
        elif "▁" in piece:
            out = piece.replace("▁", " ").encode()
        else:
            out = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        self._bytes_cache[token_id] = out
        return out

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip_special_tokens)


_BYTE_DECODER = _gpt2_byte_decoder()


class IncrementalDetokenizer:
    """Turns ids into text as they arrive, never splitting a UTF-8 character.

    Text is released only when the decoded window no longer ends in U+FFFD (an
    incomplete character); the window starts a few tokens back so tokenizers
    that strip a leading space per decode call still produce the right text.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_skip", "_tok")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def feed(self, ids: list[int]) -> str:
        if not ids:
            return ""
        self._ids.extend(ids)
        decode = self._tok.decode
        prefix_text = (
            decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
            if self._read > self._prefix
            else ""
        )
        new_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return out
        return ""

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character becomes U+FFFD)."""
        if self._read >= len(self._ids):
            return ""
        decode = self._tok.decode
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        new_text = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
