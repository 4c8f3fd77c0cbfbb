"""Where a rendered prompt may be cut so that its two sides, tokenized apart, give exactly the
ids of the whole: at the start of an added token.

Why that holds (HF `tokenizers`): encoding first splits the text at every added token it
matches (leftmost-longest, on the raw text for tokens with `normalized: false`); each
stretch between two of them is normalized, pre-tokenized and run through the model on its
own, and the ids are the stretches' ids in order (no special tokens added here). A cut at
position c, where an added token starts, is one of those split points, so the stretches on
each side of it are the same whether the text is encoded whole or as text[:c] and text[c:],
provided:
- the token at c is matched on raw text (`normalized: false`), takes no whitespace before
  it (`lstrip: false`: it would reach across the cut) and needs no word boundary
  (`single_word: false`);
- the token at c is never emitted by the model itself (the unknown token is: its id in
  the ids then marks no occurrence of its text);
- no added token's content contains another's, and no added token ends with what another
  begins with: then where added tokens match does not depend on how far the text goes, so
  text[:c] and text[c:] find the same matches as the whole does on each side.
A tokenizer that breaks the second rule has no cuts at all (`Cuts.of` returns None) and its
prompts are always tokenized whole. A Metaspace pre-tokenizer that prepends "▁" only to the
first stretch of a text is unaffected: text[c:] starts with an added token, whose stretch
is never pre-tokenized.
"""

from __future__ import annotations

import re
from typing import Any


class Cuts:
    """The added tokens a prompt may be cut before, and where they occur in a text."""

    __slots__ = ("_pattern", "ids")

    def __init__(self, contents: dict[str, int]) -> None:
        self.ids = contents
        # Longest first: the regex alternation takes the first alternative that matches.
        alternatives = sorted(contents, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(c) for c in alternatives))

    @classmethod
    def of(cls, added_tokens: list[dict[str, Any]], unk_token: str | None = None) -> Cuts | None:
        """The cuts of a tokenizer with these added tokens (tokenizer.json's entries), or None
        when cutting is not provably exact for it (see the module's docstring)."""
        contents = [t.get("content") for t in added_tokens]
        strings = [c for c in contents if isinstance(c, str) and c]
        if len(strings) != len(contents):
            return None
        if len(set(strings)) != len(strings):
            return None
        for a in strings:
            for b in strings:
                if b != a and b in a:
                    return None
                # A suffix of a that begins b (a == b: a token that overlaps itself).
                if any(a.endswith(b[:k]) for k in range(1, min(len(a), len(b)))):
                    return None
        usable = {
            str(t["content"]): int(t["id"])
            for t in added_tokens
            if not t.get("normalized")
            and not t.get("lstrip")
            and not t.get("single_word")
            and t["content"] != unk_token
        }
        return cls(usable) if usable else None

    def at(self, text: str, pos: int) -> bool:
        """Whether `text` may be cut at `pos` (an added token starts there)."""
        return self._pattern.match(text, pos) is not None

    def matches(self, text: str, start: int = 0) -> list[tuple[int, int]]:
        """(position, token id) of every cut of `text` from `start` on."""
        ids = self.ids
        return [(m.start(), ids[m.group()]) for m in self._pattern.finditer(text, start)]
