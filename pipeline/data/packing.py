"""Tokenize documents and pack them into fixed contexts, keeping each token's doc_id and position.

Rows of the store are the tokens of these contexts in order, so packing defines the store: it must
be deterministic (same config, same rows) and it must say where every token came from, because an
activation whose source cannot be found is useless for interpretation work.

- `doc_id` is the row index of the document in the source (skipped rows keep their index, so
  `doc_id` looks the text up again); `position` is the token's index in that document's token
  sequence (the per-document BOS, when there is one, is position 0).
- A BOS inserted at the start of a context belongs to no document: doc_id = position = -2
  (`META_INSERTED`; -1 is the store's "never written"). Readers exclude such rows by token id or
  by `doc_id < 0`.
- Each block of the corpus is packed on its own (contexts never straddle blocks) and drops its own
  incomplete last context, as SAE pipelines drop the corpus's: a short context would be the only
  one of its length. So a block's rows are a pure function of (block, config), whoever packs it.

A block is packed as a stream of *chunks* (`BlockPacker`): a chunk ends at a context boundary after
`chunk_contexts` contexts, and records the cursor (source row, reader position, token offset) at
which it starts. Packing resumed at a chunk's cursor gives that chunk and every later one again,
bit for bit: that is how a resumed run re-creates the tokens of uncommitted units without
re-tokenising what came before them in the block.

Chat input (`pad_token_id` given, data.format: chat): each document is one rendered conversation
with a role per token, and a context never holds tokens of two conversations: the context a
conversation ends in is filled with pad rows (doc_id = position = -2, role `pad`). Packing them
back to back would let a conversation attend to the one before it, which no chat model ever sees;
padding keeps the store's geometry (every context C rows, units of whole contexts) for a cost
of (C - tail) pad rows per conversation, counted in `tokens_padded` (choose packing.context_size
near the conversations' length). A conversation longer than C continues in the next context
(overflow: split, the context starting mid-conversation as a split document's does) or is cut
(overflow: truncate).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from ..config.run import PackingConfig
from ...store import META_INSERTED, roles as _roles
from ..messages import ChunkDescriptor


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
    docs_capped: int = 0  # documents cut at packing.max_doc_tokens (only a prefix tokenised)
    tokens_padded: int = 0  # chat: pad rows after a conversation's end (module docstring)
    budget_reached: bool = False

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def add(self, other: dict) -> None:
        for k, v in other.items():
            if k == "budget_reached":
                self.budget_reached = self.budget_reached or bool(v)
            elif hasattr(self, k):
                setattr(self, k, getattr(self, k) + int(v))


@dataclass
class Chunk:
    """Contexts [first context, + n_contexts) of one block, with where packing started them."""

    block: int
    index: int
    token_id: np.ndarray  # int32 [n_contexts * C]
    doc_id: np.ndarray    # int64: block-local source row (META_INSERTED for an inserted BOS)
    position: np.ndarray  # int32
    n_contexts: int
    cursor: dict          # {"row", "pos", "offset"} where this chunk's first context starts
    final: bool           # the block ends with this chunk
    rows: int             # source rows read so far in the block (all of them once final)
    stats: dict = field(default_factory=dict)
    capped: bool = False  # stopped at the run's context budget, not at the block's end
    role: "np.ndarray | None" = None  # int8 role codes (chat input only, store/format/roles.py)

    def digest(self) -> list[int]:
        from .unit_rows import chunk_digest

        return chunk_digest(self.arrays())

    def arrays(self) -> dict:
        out = {"token_id": self.token_id, "doc_id": self.doc_id, "position": self.position}
        if self.role is not None:
            out["role"] = self.role
        return out

    def describe(self) -> ChunkDescriptor:
        """Everything but the tokens: what the driver and the plan keep."""
        return ChunkDescriptor(block=self.block, chunk=self.index, n_contexts=self.n_contexts,
                               cursor=self.cursor, final=self.final, rows=self.rows,
                               digest=tuple(self.digest()), stats=self.stats, capped=self.capped)


class _Growable:
    def __init__(self, dtype, cap: int = 1 << 12):
        self.buf = np.empty(cap, dtype=dtype)
        self.n = 0

    def extend(self, values) -> None:
        need = self.n + len(values)
        if need > len(self.buf):
            new = np.empty(max(need, 2 * len(self.buf)), dtype=self.buf.dtype)
            new[: self.n] = self.buf[: self.n]
            self.buf = new
        self.buf[self.n : need] = values
        self.n = need

    def take(self, n: int) -> np.ndarray:
        """The first n values (a copy); the rest is dropped."""
        out = self.buf[:n].copy()
        self.n = 0
        return out


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


class BlockPacker:
    """Packs one block's documents into chunks of contexts (see the module docstring).

    Feed documents in source order with `add` (or `skip` for rows without usable text); each call
    returns the chunks it completed. `finish` returns the last one. `start` resumes at a chunk's
    cursor: its document is the first one fed, and packing starts at its token `offset`.
    """

    def __init__(self, cfg: PackingConfig, bos_token_id: int | None, block: int = 0,
                 chunk_contexts: int = 1 << 30, max_contexts: int | None = None,
                 start: dict | None = None, first_index: int = 0,
                 pad_token_id: int | None = None):
        self.C = cfg.context_size
        self.pad = pad_token_id  # chat input: pad each conversation's last context
        self.rol = _Growable(np.int8) if pad_token_id is not None else None
        self.per_context_bos = cfg.bos == "context"
        self.per_doc_bos = cfg.bos == "document"
        if (self.per_context_bos or self.per_doc_bos) and bos_token_id is None:
            raise PackingError(f"packing.bos={cfg.bos!r} needs a BOS id: set packing.bos_token_id")
        self.bos = bos_token_id
        self.truncate = cfg.overflow == "truncate"
        self.block, self.index = block, first_index
        self.chunk_contexts = max(1, int(chunk_contexts))
        self.max_contexts = max_contexts
        self.tok, self.doc, self.pos = _Growable(np.int32), _Growable(np.int64), _Growable(np.int32)
        self.stats = PackStats()
        self.data: dict = {"rows_read": 0, "rows_skipped": 0, "skipped_reasons": {}}
        self.fill = 0             # tokens in the open context
        self.ctx_in_chunk = 0     # complete contexts in the current chunk
        self.ctx_total = 0        # complete contexts in this block (from the start cursor on)
        self.boundary = False     # the current chunk is full: emit it before the next token
        start = start or {"row": 0, "pos": None, "offset": 0}
        self.cursor = dict(start)
        self.resume_offset = int(start.get("offset") or 0)
        # source rows read before this chunk: a document resumed mid-way was read already
        self.rows = int(start["row"]) + (1 if self.resume_offset else 0)
        self.done = max_contexts == 0

    # ---- feeding -------------------------------------------------------------------------------
    def skip(self, row: int, reason: str) -> list[Chunk]:
        self._read(row)
        self.data["rows_skipped"] += 1
        r = self.data["skipped_reasons"]
        r[reason] = r.get(reason, 0) + 1
        return []

    def add(self, row: int, pos, ids, roles=None, whole: bool = False) -> list[Chunk]:
        """One document's token ids (no special tokens added); `roles`: chat input's role code
        per token (required with pad_token_id, see the module docstring). `whole`: the ids are
        one context as they are (a pre-tokenised row of exactly context_size ids arriving at a
        context boundary, pipeline/data/token_input.py): no BOS is inserted.

        A document's figures (row read, tokens seen) go to the chunk its first token lands in,
        and a document resumed mid-way is not counted again: so the chunks a resumed packer
        re-creates carry the same figures as the first time.
        """
        out: list[Chunk] = []
        if self.done:
            return out
        resumed = self.resume_offset
        self.resume_offset = 0
        ids = np.asarray(ids, dtype=np.int32)
        if (roles is None) != (self.rol is None) or roles is not None and len(roles) != len(ids):
            raise ValueError("BlockPacker.add: roles go with chat input (pad_token_id), one per id")
        if len(ids) == 0:
            self._read(row)
            self.stats.docs_empty_tokens += 1
            return out
        if self.per_doc_bos and not whole:
            ids = np.concatenate([np.array([self.bos], np.int32), ids])
        off = resumed
        if self.boundary and off < len(ids):
            out.append(self._emit({"row": row, "pos": pos, "offset": off}))
        if not resumed:
            self._read(row)
            self.stats.docs_used += 1
            self.stats.tokens_seen += len(ids)
            self.stats.bos_inserted += int(self.per_doc_bos and not whole)
        while off < len(ids):
            if self.boundary:
                out.append(self._emit({"row": row, "pos": pos, "offset": off}))
            if self.fill == 0 and self.per_context_bos and not whole:
                self.tok.extend(np.array([self.bos], np.int32))
                self.doc.extend(np.array([META_INSERTED], np.int64))
                self.pos.extend(np.array([META_INSERTED], np.int32))
                self.stats.bos_inserted += 1
                self.fill = 1
            take = min(self.C - self.fill, len(ids) - off)
            self.tok.extend(ids[off : off + take])
            self.doc.extend(np.full(take, row, np.int64))
            self.pos.extend(np.arange(off, off + take, dtype=np.int32))
            if self.rol is not None:
                self.rol.extend(np.asarray(roles[off : off + take], np.int8))
            self.fill += take
            off += take
            if self.fill == self.C:
                if self._context_done() or self.truncate:
                    break
        if off < len(ids):
            self.stats.tokens_truncated += len(ids) - off
        if self.rol is not None and self.fill and not self.done:
            self._pad()
        return out

    def _context_done(self) -> bool:
        """The open context is full: count it; True when the run's budget is reached."""
        self.fill = 0
        self.ctx_in_chunk += 1
        self.ctx_total += 1
        if self.max_contexts is not None and self.ctx_total >= self.max_contexts:
            self.stats.budget_reached = True
            self.done = True
            return True
        if self.ctx_in_chunk >= self.chunk_contexts:
            self.boundary = True
        return False

    def _pad(self) -> None:
        """Chat: fill the rest of the open context with pad rows, so the next conversation
        starts a context of its own (module docstring)."""
        n = self.C - self.fill
        self.tok.extend(np.full(n, self.pad, np.int32))
        self.doc.extend(np.full(n, META_INSERTED, np.int64))
        self.pos.extend(np.full(n, META_INSERTED, np.int32))
        self.rol.extend(np.full(n, _roles.PAD, np.int8))
        self.stats.tokens_padded += n
        self._context_done()

    def finish(self) -> list[Chunk]:
        """The block's last chunk (possibly without contexts): drops the incomplete context."""
        if self.fill:
            self.stats.tokens_tail_dropped += self.fill - (1 if self.per_context_bos else 0)
            self.fill = 0
        capped = self.done and self.stats.budget_reached  # before _emit resets the stats
        c = self._emit(None)
        c.final, c.capped = True, capped
        return [c]

    # ---- internals -----------------------------------------------------------------------------
    def _read(self, row: int) -> None:
        self.data["rows_read"] += 1
        self.rows = row + 1

    def _emit(self, next_cursor: dict | None) -> Chunk:
        n = self.ctx_in_chunk * self.C
        stats = {**self.stats.as_dict(), **self.data}
        c = Chunk(self.block, self.index, self.tok.take(n), self.doc.take(n), self.pos.take(n),
                  self.ctx_in_chunk, self.cursor, False, self.rows, stats,
                  role=None if self.rol is None else self.rol.take(n))
        self.index += 1
        self.ctx_in_chunk = 0
        self.boundary = False
        self.stats = PackStats()
        self.data = {"rows_read": 0, "rows_skipped": 0, "skipped_reasons": {}}
        if next_cursor is not None:
            self.cursor = next_cursor
        return c


@dataclass
class Packed:
    """Row metadata of packed contexts: `n_contexts * context_size` rows (tests, `harvest plan`)."""

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

    def tokens_sha256(self) -> str:
        h = hashlib.sha256()
        for a in (self.token_ids, self.doc_ids, self.positions):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(str(self.context_size).encode())
        return h.hexdigest()


def pack_token_docs(
    docs: Iterable[tuple[int, "list[int] | np.ndarray"]],
    cfg: PackingConfig,
    bos_token_id: int | None,
) -> Packed:
    """Pack (doc_id, token ids) pairs as one block; stops reading at `max_tokens` rows."""
    max_contexts = None if cfg.max_tokens is None else cfg.max_tokens // cfg.context_size
    p = BlockPacker(cfg, bos_token_id, max_contexts=max_contexts)
    chunks: list[Chunk] = []
    for doc_id, ids in docs:
        if p.done:
            break
        chunks += p.add(doc_id, None, ids)
    chunks += p.finish()
    stats = PackStats()
    for c in chunks:
        stats.add({k: v for k, v in c.stats.items() if k in PackStats.__dataclass_fields__})
    cat = lambda name: np.concatenate([getattr(c, name) for c in chunks])  # noqa: E731
    return Packed(cat("token_id"), cat("doc_id"), cat("position"), cfg.context_size, stats)


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


def emit_until(chunks, last_index: "int | None"):
    """Yield `chunks` up to and including the one numbered `last_index` (all if None); returns
    True once that chunk was yielded, so the caller stops reading its block."""
    for c in chunks:
        yield c
        if last_index is not None and c.index >= last_index:
            return True
    return False
