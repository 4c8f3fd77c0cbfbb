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
# Texts longer than this are encoded with the batch encoder (which releases the GIL); below
# it the plain one is cheaper (no batch set-up) and takes well under a millisecond.
_ENCODE_INLINE_CHARS = 4096
# A text this long, with a limit, is first counted in pieces (`_counted_past`): a prompt of
# megabytes that cannot fit is refused after the pieces that prove it, never tokenized whole.
_COUNT_IN_PIECES_CHARS = 256 * 1024
_PIECE_CHARS = 64 * 1024
_PIECES_PER_BATCH = 8
# Tokens a cut between two pieces may add or remove (merges across it, a prefix marker).
_TOKENS_PER_CUT = 8


class PromptTooLong(Exception):
    """The prompt has `tokens` tokens (`exact`) or at least that many (known from its length
    alone), which the context cannot hold."""

    def __init__(self, tokens: int, *, exact: bool = True) -> None:
        super().__init__(f"the prompt is {'' if exact else 'at least '}{tokens} tokens")
        self.tokens = tokens
        self.exact = exact


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


# How much a normalizer may shorten text, in characters (1: never; NFC composes at most 4
# characters into one, e.g. Greek alpha with three marks). A normalizer not listed may shorten
# it without bound (Strip, a Replace by less): no cheap bound is used then.
_SHRINK = {"Prepend": 1, "ByteLevel": 1, "NFD": 1, "NFKD": 1, "NFC": 4}


def _shrink(normalizer: Any) -> int:
    """Most characters of text one normalized character comes from; 0 if unbounded."""
    if normalizer is None:
        return 1
    if not isinstance(normalizer, dict):
        return 0
    kind = normalizer.get("type")
    if kind == "Sequence":
        out = 1
        for n in normalizer.get("normalizers") or []:
            f = _shrink(n)
            if not f:
                return 0
            out *= f
        return out
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content")
        ok = isinstance(pattern, str) and isinstance(content, str) and len(content) >= len(pattern)
        return 1 if ok else 0
    return _SHRINK.get(kind, 0) if isinstance(kind, str) else 0


def _max_token_chars(tok_json: dict[str, Any]) -> int:
    """Most characters of the original text one token can stand for, 0 if there is no bound.

    A BPE token stands for its piece (byte-level pieces: one character per byte; every piece
    is at most its UTF-8 length in bytes, so at most that many characters of normalized text),
    an added token for its content; times what the normalizer may fold into one character.
    An unknown run fused into one token (`fuse_unk` without byte fallback), and WordPiece's or
    Unigram's unknown words, have no bound.
    """
    model = tok_json.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return 0
    if model.get("fuse_unk") and not model.get("byte_fallback"):
        return 0
    shrink = _shrink(tok_json.get("normalizer"))
    if not shrink:
        return 0
    longest = max((len(p.encode()) for p in vocab), default=0)
    for t in tok_json.get("added_tokens") or []:
        content = t.get("content") if isinstance(t, dict) else None
        if isinstance(content, str):
            longest = max(longest, len(content.encode()))
    return longest * shrink


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
    # Most characters one token stands for (0: unknown); see min_tokens.
    max_token_chars: int = 0
    # tokenizer.json's added tokens, as written there (content, id and matching flags):
    # where a prompt may be cut and its sides tokenized apart (prompt/cuts.py).
    added_tokens: list[dict[str, Any]] = field(default_factory=list)
    # The model's unknown token: an added token the model itself emits, for text it has no
    # piece for.
    unk_token: str | None = None
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
            max_token_chars=_max_token_chars(tok_json),
            added_tokens=[t for t in tok_json.get("added_tokens") or [] if isinstance(t, dict)],
            unk_token=_token_content((tok_json.get("model") or {}).get("unk_token")),
            _byte_level="ByteLevel" in kinds,
            _byte_fallback="ByteFallback" in kinds,
        )

    def encode(self, text: str, *, add_special_tokens: bool = False, limit: int = 0) -> list[int]:
        """Token ids of `text`; PromptTooLong if there are `limit` or more (0 = no limit)."""
        if limit and len(text) > _COUNT_IN_PIECES_CHARS:
            if (n := self._counted_past(text, limit)) is not None:
                raise PromptTooLong(n, exact=False)
        if len(text) > _ENCODE_INLINE_CHARS:
            # The tokenizers library holds the GIL for the whole of `encode` (measured: a
            # thread encoding 1 MB let the event loop run twice in 130 ms), but releases it in
            # the batch encoders: a long prompt, tokenized on a worker thread, then leaves
            # the loop free. Same ids (the same pipeline); `_fast` skips the offsets.
            batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
            enc = batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # Counted before the ids become a Python list: building a list of millions of ints
        # holds the GIL (half a second for 5.8 M), for a prompt refused anyway.
        if limit and len(enc) >= limit:
            raise PromptTooLong(len(enc))
        return enc.ids

    def encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        """The ids of each piece, tokenized apart (no special tokens added), in one batch: the
        batch encoder releases the GIL, and one call per turn costs less than one per piece."""
        if not pieces:
            return []
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in batch(pieces, add_special_tokens=False)]

    def _counted_past(self, text: str, limit: int) -> int | None:
        """A token count that proves `text` holds `limit` tokens or more, or None.

        Whole, a 7 MB prompt is a 5.8 M-token `Encoding` that the tokenizers library builds and
        frees holding the GIL (~0.1 s of CPU, seconds on a loaded machine), which stalls the
        proxy's event loop. In pieces cut at spaces, each piece's `Encoding` is small, and the
        count stops once it is past the limit by more than the cuts can account for."""
        batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        counted, cuts, start = 0, 0, 0
        while start < len(text):
            pieces: list[str] = []
            while start < len(text) and len(pieces) < _PIECES_PER_BATCH:
                end = min(start + _PIECE_CHARS, len(text))
                if end < len(text):
                    space = text.rfind(" ", start + _PIECE_CHARS // 2, end)
                    end = space if space > start else end
                pieces.append(text[start:end])
                start = end
            counted += sum(len(e) for e in batch(pieces, add_special_tokens=False))
            cuts += len(pieces)
            if counted - cuts * _TOKENS_PER_CUT >= limit:
                return counted - cuts * _TOKENS_PER_CUT
        return None

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), from its length alone (0 when unknown).

        Costs nothing, where encoding megabytes takes seconds: a prompt that cannot fit the
        context is refused before it is tokenized."""
        if not self.max_token_chars:
            return 0
        return -(-len(text) // self.max_token_chars)

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
