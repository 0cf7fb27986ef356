"""Tokenising a bounded prefix of a long text: the first `cap` tokens of a document (or of a
rendered conversation) without tokenising the whole of it.

Tokenising a 30 MB document whole took 6.3 GB in the worker for 4096 tokens kept. The prefix
grows (doubling) from (cap + PREFIX_MARGIN) * PREFIX_CHARS_PER_TOKEN characters until it gives
cap + PREFIX_MARGIN tokens or is the whole text, so the kept tokens are the whole text's first
`cap` tokens: the last tokens of a prefix cut mid-word differ from the whole text's, and those
are never kept. Text packing (tokenize.py) and chat labelling (chat.py) both cut here.
"""

from __future__ import annotations

# A text longer than this many characters per kept token is tokenised from a prefix only.
PREFIX_CHARS_PER_TOKEN = 8
# Tokens beyond the cap a prefix must give before its tail is trusted.
PREFIX_MARGIN = 64


def long_chars(cap: int) -> int:
    """Texts up to this many characters are tokenised whole for a cap of `cap` tokens."""
    return max(1, cap + PREFIX_MARGIN) * PREFIX_CHARS_PER_TOKEN


def capped_encoding(tokenizer, text: str, cap: int, offsets: bool = False):
    """(the tokenizer's encoding of the shortest doubling prefix of `text` whose first `cap`
    tokens are the whole text's, whether the whole text has more than `cap` tokens). The
    encoding may hold more than `cap` tokens: cut it. `offsets`: with character offsets (a fast
    tokenizer's `offset_mapping`)."""
    extra = {"return_offsets_mapping": True} if offsets else {}
    n = long_chars(cap)
    while True:
        whole = n >= len(text)
        enc = tokenizer(text if whole else text[:n], add_special_tokens=False, **extra)
        if whole or len(enc["input_ids"]) >= cap + PREFIX_MARGIN:
            return enc, len(enc["input_ids"]) > cap or not whole
        n *= 2


def capped_ids(tokenizer, text: str, cap: int) -> "tuple[list[int], bool]":
    """(the first `cap` tokens of `text`, whether any were dropped), tokenising a bounded prefix
    (module docstring)."""
    enc, cut = capped_encoding(tokenizer, text, cap)
    return list(enc["input_ids"][:cap]), cut
