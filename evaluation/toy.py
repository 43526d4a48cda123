"""A character tokenizer for tiny random models, so that every recipe runs end to end with nothing downloaded."""

from __future__ import annotations

import string

CHARS = string.digits + string.ascii_letters + " .,?!'\"\n:-;()"


class CharTokenizer:
    """One token per character of :data:`CHARS` (others read as a space), ids from ``offset``; a BOS id 1 in front
    when ``add_special_tokens``. Fits a vocabulary of ``offset + len(CHARS)`` (96 for the tiny test models)."""

    def __init__(self, offset: int = 3, bos: bool = True) -> None:
        self.offset, self.bos = offset, bos
        self.eos_token_id = 2
        self.vocab_size = offset + len(CHARS)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [1] if self.bos and add_special_tokens else []
        return ids + [self.offset + (CHARS.index(c) if c in CHARS else CHARS.index(" ")) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(CHARS[i - self.offset] for i in ids if self.offset <= int(i) < self.vocab_size)
