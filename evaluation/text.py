"""Long real text as tokens, and the completion-style pass-key (needle-in-a-haystack) prompt.

A tokenizer here is anything with ``encode(text, add_special_tokens=...) -> list[int]`` and
``decode(ids) -> str`` (every HuggingFace tokenizer has both).
"""

from __future__ import annotations

import random
import re
from typing import Any

SENTENCE_ENDS = (".", "!", "?", '."', '!"', '?"', ".)")
HEADER = (
    "There is a {key} hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the {key} at the end.\n\n"
)
NEEDLE = "The {key} is {value}. Remember it. {value} is the {key}."
QUESTION = "\n\nWhat is the {key}? The {key} is"
MAX_SCAN = 256  # tokens searched on each side of the asked depth for a sentence boundary


def _essays(essays: str | None) -> str:
    if essays is not None:
        return essays
    from .assets import load_essays

    return load_essays()


def essay_tokens(tokenizer: Any, n_tokens: int, offset: int = 0, essays: str | None = None) -> list[int]:
    """``n_tokens`` token ids of the essays text (no special tokens), starting at token ``offset``.

    Only as much text as needed is tokenized (a prefix that grows until it holds the tokens asked for, with a
    margin so that a word cut at the prefix's end cannot reach them). ``essays`` defaults to
    :func:`evaluation.assets.load_essays`. Raises ``ValueError`` when the text is too short.
    """
    if n_tokens < 0 or offset < 0:
        raise ValueError(f"n_tokens and offset must be >= 0, got {n_tokens} and {offset}")
    text = _essays(essays)
    need, margin = offset + n_tokens, 16
    chars = 6 * (need + margin)
    while True:
        cut = text.find(" ", chars)
        whole = chars >= len(text) or cut < 0
        ids = tokenizer.encode(text if whole else text[:cut], add_special_tokens=False)
        if whole or len(ids) >= need + margin:
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(
            f"the essays hold {len(ids)} tokens with this tokenizer; asked for {n_tokens} tokens from offset {offset}"
        )
    return list(ids[offset:need])


def _is_boundary(tokenizer: Any, token_id: int) -> bool:
    piece = tokenizer.decode([token_id])
    return "\n" in piece or piece.rstrip().endswith(SENTENCE_ENDS)


def _boundary_near(tokenizer: Any, ids: list[int], target: int) -> int:
    """The insertion point (a sentence boundary: after a sentence's last token) nearest ``target``.

    The start and the end of ``ids`` count as boundaries. Falls back to ``target`` itself when no boundary lies
    within :data:`MAX_SCAN` tokens.
    """
    for d in range(MAX_SCAN + 1):
        for i in (target - d, target + d):
            if i == 0 or i == len(ids):
                return i
            if 0 < i < len(ids) and _is_boundary(tokenizer, ids[i - 1]):
                return i
    return target


def needle_prompt(
    tokenizer: Any,
    context_tokens: int,
    depth: float,
    key: str = "pass key",
    value: str | int | None = None,
    seed: int = 0,
    offset: int = 0,
    essays: str | None = None,
) -> dict[str, Any]:
    """A completion-style pass-key prompt of about ``context_tokens`` tokens with the needle at ``depth``.

    The prompt is a short instruction, an essay haystack (from token ``offset``) with the needle
    ``"The {key} is {value}. Remember it. {value} is the {key}."`` inserted at the sentence boundary nearest the
    fraction ``depth`` in [0, 1] of the haystack, then ``"... What is the {key}? The {key} is"``. ``value`` is a
    random 5-digit number from ``random.Random(seed)`` when None.

    Returns ``{"text", "answer", "needle_token_pos", "n_tokens"}``: positions count the ids of
    ``tokenizer.encode(text)`` (special tokens included, as the model sees them); ``needle_token_pos`` is where
    the needle sentence starts.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    answer = str(random.Random(seed).randint(10_000, 99_999) if value is None else value)
    header = HEADER.format(key=key)
    needle = NEEDLE.format(key=key, value=answer)
    question = QUESTION.format(key=key)
    overhead = sum(len(tokenizer.encode(s, add_special_tokens=False)) for s in (header, needle, question))
    n_hay = context_tokens - overhead - 2  # 2: the separators around the needle
    if n_hay <= 0:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for a haystack (overhead {overhead})")
    hay = essay_tokens(tokenizer, n_hay, offset=offset, essays=essays)
    at = _boundary_near(tokenizer, hay, round(depth * n_hay))
    before = tokenizer.decode(hay[:at]).rstrip()
    after = tokenizer.decode(hay[at:]).lstrip()
    prefix = header + before + (" " if before else "")
    text = prefix + needle + (" " + after if after else "") + question
    # Where the needle starts in encode(text): the special tokens put in front, then the prefix's tokens (the
    # space before the needle belongs to the needle's first token, as BPE and SentencePiece tokenizers split it).
    # A whitespace-only token left between them (a newline not merged into the needle) is skipped.
    ids = tokenizer.encode(text)
    pos = _leading_specials(tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False))
    pos += len(tokenizer.encode(prefix.rstrip(), add_special_tokens=False))
    while pos < len(ids) and not tokenizer.decode([ids[pos]]).strip():
        pos += 1
    return {"text": text, "answer": answer, "needle_token_pos": pos, "n_tokens": len(ids)}


def _leading_specials(with_special: list[int], plain: list[int]) -> int:
    """How many special tokens ``encode`` puts in front of a sequence (e.g. BOS)."""
    for lead in range(len(with_special) - len(plain) + 1):
        if list(with_special[lead : lead + len(plain)]) == list(plain):
            return lead
    return 0


def score_answer(generated_text: str, answer: str | int) -> bool:
    """Whether the continuation starts with exactly the digits of ``answer`` (leading spaces/punctuation ignored).

    ``" 12345."`` and ``" **12345**"`` match ``12345``; ``" 123456"``, ``" 1234"`` and ``" It is 12345"`` do not.
    """
    found = re.match(r"[\W_]*(\d+)", generated_text)
    return found is not None and found.group(1) == str(answer).strip()
