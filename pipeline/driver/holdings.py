"""The tokenised chunks the driver holds (as Ray references) and the units waiting on them.

A unit can be dispatched once every chunk its contexts come from is held; a chunk is let go as
soon as no uncommitted unit uses it and the frontier no longer needs it (pinned for a unit not
emitted yet, or expected for placement). That keeps the driver's memory O(units + chunks in the
window), flat in corpus size (dispatch.py). The scheduler owns one `Holdings` and asks it which
chunks to keep and which units are ready; it never touches the fields.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..messages import UnitTask
from ..data.row_frontier import Emitted, chunk_key
from ..messages import ChunkDescriptor


@dataclass
class _Held:
    ref: object
    desc: ChunkDescriptor
    tokens: int


class Holdings:
    """Chunks held, units waiting for chunks, units ready to dispatch ((unit, attempt) pairs)."""

    def __init__(self, state, context_size: int, unit_rows: int):
        self.frontier = state.frontier
        self.C = context_size
        self.held: dict[str, _Held] = {}
        self.held_tokens = 0
        self.unit_rows = unit_rows
        # tokens the pool may hold before it pauses: a guess until the actors are known
        self.window = 8 * unit_rows
        self.users: dict[str, int] = {}       # chunk -> units not yet committed that use it
        self.waiting: dict[int, object] = {}  # planned units whose chunks are not all here
        self.missing: dict[int, set] = {}     # their missing chunks
        self.by_chunk: dict[str, list] = {}   # chunk -> waiting units that need it
        self.ready: deque = deque()           # (unit, attempt), planned, chunks held
        for u in state.todo:
            self.track(u, +1)
            self.waiting[u.unit_id] = u
            keys = {chunk_key(b, j) for b, j, *_ in u.pieces}
            self.missing[u.unit_id] = keys
            for k in keys:
                self.by_chunk.setdefault(k, []).append(u.unit_id)

    def size_window(self, n_actors: int, slots: int) -> None:
        """Hold enough tokens for every actor's slots twice over (and 4 units at least)."""
        self.window = max(4 * self.unit_rows, 2 * n_actors * slots * self.unit_rows)

    def track(self, unit, d: int) -> None:
        """Count `unit` as a user of its chunks (+1 when planned, -1 when committed)."""
        for b, j, *_ in unit.pieces:
            k = chunk_key(b, j)
            self.users[k] = self.users.get(k, 0) + d

    def release(self, keys) -> None:
        """Let go of the chunks in `keys` that nothing needs any more."""
        pinned = self.frontier.filling_chunks()
        for k in keys:
            h = self.held.get(k)
            if h is None or self.users.get(k, 0) > 0 or k in pinned:
                continue
            b, j = (int(x) for x in k.split(":"))
            if self.frontier.expects(b, j):
                continue
            del self.held[k]
            self.held_tokens -= h.tokens
            self.users.pop(k, None)

    def wants(self, block: int, chunk: int) -> bool:
        """Whether a chunk just tokenised is needed: by a planned unit or by the frontier."""
        k = chunk_key(block, chunk)
        return (self.users.get(k, 0) > 0 or self.frontier.expects(block, chunk)) \
            and k not in self.held

    def hold(self, arrays_ref, desc: ChunkDescriptor) -> None:
        """Keep the chunk; the waiting units it completes become ready."""
        k = chunk_key(desc.block, desc.chunk)
        self.held[k] = _Held(arrays_ref, desc, desc.n_contexts * self.C)
        self.held_tokens += self.held[k].tokens
        for uid in self.by_chunk.pop(k, ()):
            m = self.missing.get(uid)
            if m is not None:
                m.discard(k)
                if not m:
                    del self.missing[uid]
                    self.ready.append((self.waiting.pop(uid), 1))

    def place(self, desc: ChunkDescriptor) -> list[Emitted]:
        """The chunk's counts to the frontier; the units it completes, counted as users."""
        out = self.frontier.add(desc)
        for e in out:
            if e.unit.n_rows:
                self.track(e.unit, +1)
            self.release(list(e.chunks))
        return out

    def committed(self, unit) -> None:
        """`unit` is done: its chunks lose a user and go when nothing else needs them."""
        self.track(unit, -1)
        self.release([chunk_key(b, j) for b, j, *_ in unit.pieces])

    def task(self, unit) -> UnitTask:
        """The message an actor gets for `unit`: references to its chunks and their digests."""
        refs, digests = [], []
        for b, j, *_ in unit.pieces:
            h = self.held[chunk_key(b, j)]
            refs.append(h.ref)
            digests.append(h.desc.digest)
        return UnitTask(unit.unit_id, unit.row_start, unit.row_end,
                        pieces=tuple(tuple(p) for p in unit.pieces), refs=tuple(refs),
                        digests=tuple(digests))
