"""Tokenize documents and pack them into fixed contexts, keeping each token's doc_id and position.

Rows of the store are the tokens of these contexts in order, so packing defines the store: it must
be deterministic (same config, same rows) and it must say where every token came from, because an
activation whose source cannot be found is useless for interpretation work.

- `doc_id` is the row index of the document in the source (skipped rows keep their index, so
  `doc_id` looks the text up again); `position` is the token's index in that document's token
  sequence (the per-document BOS, when there is one, is position 0).
- A BOS inserted at the start of a context belongs to no document: doc_id = position = -1. Readers
  that must exclude BOS rows (attention-sink outliers) filter on `doc_id < 0` or on the token id.
- The last, incomplete context is dropped, as SAE pipelines do: a short context would be the only
  one of its length and its activations would not match the others' distribution.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from .config import PackingConfig


class PackingError(ValueError):
    """Packing cannot produce a single context; the message names the field and the fix."""


@dataclass
class PackStats:
    docs_used: int = 0
    docs_empty_tokens: int = 0
    tokens_seen: int = 0
    tokens_truncated: int = 0
    tokens_tail_dropped: int = 0
    bos_inserted: int = 0
    budget_reached: bool = False

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Packed:
    """Row metadata of a whole run: `n_contexts * context_size` rows."""

    token_ids: np.ndarray  # int32 [n_rows]
    doc_ids: np.ndarray  # int64 [n_rows]
    positions: np.ndarray  # int32 [n_rows]
    context_size: int
    stats: PackStats = field(default_factory=PackStats)

    @property
    def n_rows(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def n_contexts(self) -> int:
        return self.n_rows // self.context_size

    def contexts(self, row_start: int, row_end: int) -> list[list[int]]:
        ids = self.token_ids[row_start:row_end].reshape(-1, self.context_size)
        return ids.tolist()

    def tokens_sha256(self) -> str:
        """Identity of the rows: resume refuses a store whose rows came from different tokens."""
        h = hashlib.sha256()
        for a in (self.token_ids, self.doc_ids, self.positions):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(str(self.context_size).encode())
        return h.hexdigest()


class _Growable:
    def __init__(self, dtype, cap: int = 1 << 16):
        self.buf = np.empty(cap, dtype=dtype)
        self.n = 0

    def extend(self, values: np.ndarray) -> None:
        need = self.n + len(values)
        if need > len(self.buf):
            cap = max(need, 2 * len(self.buf))
            new = np.empty(cap, dtype=self.buf.dtype)
            new[: self.n] = self.buf[: self.n]
            self.buf = new
        self.buf[self.n : need] = values
        self.n = need

    def truncate(self, n: int) -> None:
        self.n = n

    def array(self) -> np.ndarray:
        return self.buf[: self.n].copy()


def resolve_bos(cfg: PackingConfig, tokenizer) -> int | None:
    if cfg.bos == "none":
        return None
    if cfg.bos_token_id is not None:
        return int(cfg.bos_token_id)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise PackingError(
            f"packing.bos={cfg.bos!r} but the tokenizer has no BOS token: set packing.bos: none, "
            "or packing.bos_token_id to the id to use (e.g. the EOS id)"
        )
    return int(bos)


def pack_token_docs(
    docs: Iterable[tuple[int, "list[int] | np.ndarray"]],
    cfg: PackingConfig,
    bos_token_id: int | None,
) -> Packed:
    """Pack (doc_id, token ids) pairs; stops reading as soon as `max_tokens` rows are filled."""
    C = cfg.context_size
    max_contexts = None if cfg.max_tokens is None else cfg.max_tokens // C
    per_context_bos = cfg.bos == "context"
    per_doc_bos = cfg.bos == "document"
    if (per_context_bos or per_doc_bos) and bos_token_id is None:
        raise PackingError(f"packing.bos={cfg.bos!r} needs a BOS id: set packing.bos_token_id")
    tok, doc, pos = _Growable(np.int32), _Growable(np.int64), _Growable(np.int32)
    stats = PackStats()
    fill = 0  # tokens in the current (open) context
    n_done = 0  # complete contexts

    def open_context():
        nonlocal fill
        if per_context_bos:
            tok.extend(np.array([bos_token_id], np.int32))
            doc.extend(np.array([-1], np.int64))
            pos.extend(np.array([-1], np.int32))
            stats.bos_inserted += 1
            fill = 1

    done = max_contexts == 0
    for doc_id, ids in docs:
        if done:
            break
        ids = np.asarray(ids, dtype=np.int32)
        if len(ids) == 0:
            stats.docs_empty_tokens += 1
            continue
        if per_doc_bos:
            ids = np.concatenate([np.array([bos_token_id], np.int32), ids])
            stats.bos_inserted += 1
        stats.docs_used += 1
        stats.tokens_seen += len(ids)
        off = 0
        while off < len(ids):
            if fill == 0:
                open_context()
            take = min(C - fill, len(ids) - off)
            tok.extend(ids[off : off + take])
            doc.extend(np.full(take, doc_id, np.int64))
            pos.extend(np.arange(off, off + take, dtype=np.int32))
            fill += take
            off += take
            if fill == C:
                fill = 0
                n_done += 1
                if max_contexts is not None and n_done >= max_contexts:
                    stats.budget_reached = True
                    done = True
                    break
                if cfg.overflow == "truncate":
                    break
        if off < len(ids):
            stats.tokens_truncated += len(ids) - off
    if fill:
        stats.tokens_tail_dropped = fill - (1 if per_context_bos else 0)
        for g in (tok, doc, pos):
            g.truncate(n_done * C)
    return Packed(tok.array(), doc.array(), pos.array(), C, stats)


def tokenize_docs(
    texts: Iterable[tuple[int, str]], tokenizer, batch: int = 256
) -> Iterator[tuple[int, list[int]]]:
    """Batched tokenization (fast tokenizers are ~10x faster per batch than per text)."""
    pending: list[tuple[int, str]] = []

    def flush():
        enc = tokenizer([t for _, t in pending], add_special_tokens=False)["input_ids"]
        for (i, _), ids in zip(pending, enc):
            yield i, ids
        pending.clear()

    for item in texts:
        pending.append(item)
        if len(pending) >= batch:
            yield from flush()
    if pending:
        yield from flush()


def pack_texts(texts: Iterable[tuple[int, str]], tokenizer, cfg: PackingConfig) -> Packed:
    bos = resolve_bos(cfg, tokenizer)
    return pack_token_docs(tokenize_docs(texts, tokenizer, cfg.tokenize_batch), cfg, bos)
