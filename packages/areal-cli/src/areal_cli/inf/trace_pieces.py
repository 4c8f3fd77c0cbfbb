"""Token ids to the text pieces they stand for, read from the model's `tokenizer.json` with
the standard library alone.

The CLI does not depend on `tokenizers` / `transformers` (their import and install cost would
fall on every `areal` command), and a trace needs no encoder: only each id's vocabulary entry
and the decoder's rule for turning it back into bytes. The rules are the data proxy's own
(`areal_proxy.common.tokenizer.ModelTokenizer.token_bytes`, which tests/test_trace_pieces.py holds
this module to): byte-level BPE maps a printable alphabet back to bytes; byte fallback spells
a byte as `<0xNN>`; SentencePiece marks a space with `▁`. Special tokens are their content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_cli.errors import CLIError

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character; this is the way back."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_LEVEL = _byte_level_alphabet()


@dataclass
class Pieces:
    """id -> text piece for one tokenizer."""

    vocab: dict[int, str]
    special: frozenset[int]
    byte_level: bool
    byte_fallback: bool

    @classmethod
    def from_dir(cls, path: str | Path) -> Pieces:
        tok_file = Path(path) / "tokenizer.json"
        try:
            data = json.loads(tok_file.read_bytes())
        except FileNotFoundError:
            raise CLIError(
                f"no tokenizer.json in {path}; pass --tokenizer-path with the model's tokenizer "
                "folder"
            ) from None
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read {tok_file}: {e}") from None
        if not isinstance(data, dict):
            raise CLIError(f"{tok_file} is not a tokenizer.json (not a JSON object)")
        model = data.get("model") or {}
        vocab: dict[int, str] = {}
        raw = model.get("vocab")
        if isinstance(raw, dict):  # BPE, WordPiece, WordLevel: piece -> id
            vocab = {int(i): str(p) for p, i in raw.items()}
        elif isinstance(raw, list):  # Unigram: [piece, score] by id
            vocab = {i: str(e[0]) for i, e in enumerate(raw) if isinstance(e, list) and e}
        special = set()
        for t in data.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("id"), int):
                vocab[t["id"]] = str(t.get("content", ""))
                if t.get("special"):
                    special.add(t["id"])
        kinds = _decoder_kinds(data.get("decoder"))
        return cls(
            vocab=vocab,
            special=frozenset(special),
            byte_level="ByteLevel" in kinds,
            byte_fallback="ByteFallback" in kinds or bool(model.get("byte_fallback")),
        )

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for (maybe part of a UTF-8 character); None when the
        id is not in the vocabulary."""
        piece = self.vocab.get(token_id)
        if piece is None:
            return None
        if token_id in self.special:
            return piece.encode()
        if self.byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if self.byte_fallback and (m := _BYTE_FALLBACK.match(piece)):
            return bytes([int(m.group(1), 16)])
        return piece.replace("▁", " ").encode()

    def piece(self, token_id: int) -> str | None:
        """The token's text; bytes that are not whole UTF-8 characters as `\\xNN`."""
        raw = self.token_bytes(token_id)
        return None if raw is None else raw.decode("utf-8", errors="backslashreplace")


def _decoder_kinds(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    return {str(d.get("type")) for d in parts or [] if isinstance(d, dict)}
