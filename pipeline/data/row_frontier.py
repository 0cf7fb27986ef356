"""Every tokenised context's global row: chunks placed in the row space, in block order, as their
counts arrive, and the work units cut from them.

Chunks are tokenised in parallel and arrive in any order; the frontier takes them in (block,
chunk) order and gives every context its global index by a running sum, so rows depend only on
the blocks' contents, never on which worker finished first. A unit (global contexts [kU, (k+1)U))
is emitted as soon as its last context is placed, so the first unit is ready after the first
chunk, however large the corpus. `packing.max_tokens` cuts at a context boundary, in block order.

Each emitted unit carries the frontier's state after it and the chunks consumed since the unit
before it (counts, digests, cursors, stats): that is what the plan segments record, and all a
resumed run needs to continue (`Frontier.resume`) or to re-create the tokens of a unit that was
planned but not committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...store import Unit
from ..messages import ChunkDescriptor


def chunk_key(block: int, chunk: int) -> str:
    return f"{block}:{chunk}"


@dataclass
class Emitted:
    unit: Unit
    chunks: dict            # chunk_key -> descriptor (without tokens) consumed since the last unit
    state: dict             # the frontier after this unit
    final: bool = False     # nothing follows it


@dataclass
class Frontier:
    context_size: int
    unit_contexts: int
    n_blocks: int
    max_contexts: int | None = None
    # A scheduled tick's stop (pipeline/driver/schedule.py): placing pauses once `placed` reaches it at a
    # unit's end. Unlike max_contexts it is not the run's end: the saved state stays `done: False`
    # and the plan not final, so the next run resumes from here exactly as after a crash, and
    # the rows of N such runs are those of one long run. A multiple of unit_contexts (a unit never
    # ends early mid-store: units start on shard boundaries). `paused` says it was reached.
    stop_contexts: int | None = None
    paused: bool = False
    placed: int = 0         # contexts placed before `pending`
    next_unit: int = 0
    next_block: int = 0
    next_chunk: int = 0
    skip_ctx: int = 0       # contexts of the next chunk already placed (resume)
    doc_base: int = 0       # source rows before next_block
    last_cursor: dict | None = None  # cursor of the last chunk consumed from next_block
    last_chunk: int = -1
    done: bool = False
    _waiting: dict = field(default_factory=dict)
    _pieces: list = field(default_factory=list)
    _ctx: int = 0           # contexts in the unit being filled
    _consumed: dict = field(default_factory=dict)

    # ---- state ---------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"placed": self.placed, "next_unit": self.next_unit, "next_block": self.next_block,
                "next_chunk": self.next_chunk, "skip_ctx": self.skip_ctx, "doc_base": self.doc_base,
                "last_cursor": self.last_cursor, "last_chunk": self.last_chunk, "done": self.done}

    @classmethod
    def resume(cls, context_size: int, unit_contexts: int, n_blocks: int,
               max_contexts: int | None, state: dict) -> "Frontier":
        f = cls(context_size, unit_contexts, n_blocks, max_contexts)
        for k in ("placed", "next_unit", "next_block", "next_chunk", "skip_ctx", "doc_base",
                  "last_cursor", "last_chunk", "done"):
            setattr(f, k, state[k])
        return f

    def expects(self, block: int, chunk: int) -> bool:
        """Is this chunk at or after the frontier (still to be placed)?"""
        return not self.done and (block, chunk) >= (self.next_block, self.next_chunk)

    def filling_chunks(self) -> set[str]:
        """The chunk keys the unit being filled holds pieces of (not emitted yet)."""
        return {chunk_key(p[0], p[1]) for p in self._pieces}

    def continuation(self) -> "tuple[int, dict | None, int] | None":
        """Where tokenising must (re)start for the frontier to go on: (block, cursor, chunk)."""
        if self.done or self.next_block >= self.n_blocks:
            return None
        if self.last_chunk >= 0 and self.last_cursor is not None:
            return self.next_block, self.last_cursor, self.last_chunk
        return self.next_block, None, 0

    # ---- placing -------------------------------------------------------------------------------
    def add(self, desc: ChunkDescriptor) -> list[Emitted]:
        """A chunk's descriptor; returns the units it completed."""
        key = (desc.block, desc.chunk)
        if not self.expects(*key):
            return []
        self._waiting[key] = desc
        out: list[Emitted] = []
        while not self.done:
            d = self._waiting.pop((self.next_block, self.next_chunk), None)
            if d is None:
                break
            out += self._place(d)
        return out

    def _place(self, d: ChunkDescriptor) -> list[Emitted]:
        out: list[Emitted] = []
        b, j, n = d.block, d.chunk, d.n_contexts
        self._consumed[chunk_key(b, j)] = d.plan_record()
        lo = self.skip_ctx
        self.skip_ctx = 0
        self.last_cursor, self.last_chunk = d.cursor, j
        while lo < n and not self.done:
            room = self.unit_contexts - self._ctx
            if self.max_contexts is not None:
                room = min(room, self.max_contexts - self.placed - self._ctx)
            take = min(room, n - lo)
            self._pieces.append((b, j, lo, lo + take, self.doc_base))
            self._ctx += take
            lo += take
            budget_hit = self.max_contexts is not None and self.placed + self._ctx >= self.max_contexts
            if self._ctx == self.unit_contexts or budget_hit:
                # the unit ends inside or at the end of this chunk: resume re-reads it from its cursor
                self.next_chunk, self.skip_ctx = (j, lo) if lo < n else (j + 1, 0)
                if lo >= n and d.final:
                    self._next_block(d)
                if budget_hit:
                    self.done = True
                out.append(self._emit())
                if (not self.done and self.stop_contexts is not None
                        and self.placed >= self.stop_contexts and self.next_block < self.n_blocks):
                    # after _emit: the recorded state is the resumable one (done False, not final);
                    # at the data's end it is not a pause but the run's end (below)
                    self.paused = self.done = True
        if self.done:
            return out
        if lo >= n:
            if d.final:
                self._next_block(d)
            else:
                self.next_chunk, self.skip_ctx = j + 1, 0
        if self.next_block >= self.n_blocks:
            # the data's end: always one last emission, empty when a unit ended exactly at the
            # last chunk, so the plan is marked final (finalize refuses a plan that is not)
            self.done = True
            out.append(self._emit())
        return out

    def _next_block(self, d: ChunkDescriptor) -> None:
        if self.next_block != d.block:
            return  # already advanced (a unit ended exactly at this final chunk)
        self.doc_base += d.rows
        self.next_block += 1
        self.next_chunk, self.skip_ctx = 0, 0
        self.last_cursor, self.last_chunk = None, -1

    def _emit(self) -> Emitted:
        C = self.context_size
        rs = self.placed * C
        self.placed += self._ctx
        u = Unit(self.next_unit, rs, self.placed * C, tuple(self._pieces))
        if self._ctx:
            self.next_unit += 1
        e = Emitted(u, self._consumed, self.state(), final=self.done)
        self._pieces, self._ctx, self._consumed = [], 0, {}
        return e


def sum_stats(descs) -> dict:
    """Source-row and packing figures summed over chunk descriptors."""
    out: dict = {}
    for d in descs:
        for key, v in (d.get("stats") or {}).items():
            if key == "skipped_reasons":
                r = out.setdefault(key, {})
                for why, n in v.items():
                    r[why] = r.get(why, 0) + n
            elif isinstance(v, bool):
                out[key] = out.get(key, False) or v
            else:
                out[key] = out.get(key, 0) + v
    return out
