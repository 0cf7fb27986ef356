"""A shared-memory ring of engine steps: how rows leave a tensor-parallel worker process.

With tensor_parallel_size > 1 vLLM runs every rank's model in its own worker process (the
multiprocessing executor); the capture loop and the writers' buffers stay in the engine's
process (the Ray actor). One rank, the one whose step output vLLM itself returns (TP rank 0 of
the last pipeline stage: compat.is_output_rank), publishes each step here: the step's row map
(request ids, scheduled counts, first positions), the positions and token ids the model was fed,
and the tap buffer's rows. The capture loop reads the step right after `engine.step()` returns
and runs the same planning, fed-token, stray-row and coverage checks as the in-process path
(harvest.HarvestState) before copying the rows into each request's destination.

One host copy: a destination that lies in the engine's shared destination arena
(engine/capture/shmdest.py: the writers' block buffers live there) is registered through this file's
registration log (request id, generation, offset, length, point stride; written by the engine's
process before the request is added, read by the publishing rank at the start of its next step),
and the rank writes that request's rows straight into it; the slot then carries only the row map,
the fed positions and token ids and, per request, the generation it placed (0: not placed, its
rows are in the slot's rows as before). A request whose destination is elsewhere (a fresh tensor,
an arena that was full) still takes the slot's rows and one extra copy in the engine's process.

Why a ring and sequence numbers: `engine.step()` runs one forward on this build, and the loop
reads after every step, so one slot would do; two slots and a per-slot sequence number turn any
break of that assumption (a vLLM that runs two forwards per step, a loop that skipped a read)
into a loud "overran" error instead of a step's rows silently replaced by the next step's.

The file lives in /dev/shm; the engine's process creates it before vLLM starts the workers and
unlinks it once they have mapped it, so nothing is left behind when any process dies.
"""

from __future__ import annotations

import json
import mmap
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .shmdest import LOG_HEAD, LOG_READ, RECORD, Placer, reserve

SLOTS = 2
ALIGN = 64
CONTROL = 64  # int64 [latest seq, error length, publish ns, rows-copy ns, steps published,
#                     registrations written (engine), registrations read (rank), rows placed]
ERROR_BYTES = 4096
# Words 5 and 6 (LOG_HEAD, LOG_READ) and the record layout (RECORD) belong to the registration
# log, defined where its two sides are (engine/capture/shmdest.py); this file only sizes and places the
# log in the file. The import goes this way only (shmdest never imports stepring: it is handed
# the mapped ring), so the two modules are no import cycle.
PLACED = 7  # control word
assert PLACED not in (LOG_HEAD, LOG_READ) and max(LOG_HEAD, LOG_READ, PLACED) < CONTROL // 8
SHM_DIR = "/dev/shm"
# The spec reaches the workers in their environment, not in additional_config: vLLM hashes
# additional_config into its compile-cache key (VllmConfig.compute_hash, checked 0.32.0), and a
# per-engine file name there made every tensor-parallel engine start (every actor, every
# restart) miss the cache and compile its graph again. The mp executor spawns the workers while
# vllm.LLM() is being built, so they inherit the variable the engine sets around that call.
RING_ENV = "HARVEST_STEP_RING"


@dataclass(frozen=True)
class RingSpec:
    """Geometry of the ring; travels to the workers in additional_config["harvest"]["ring"]."""

    path: str
    n_points: int
    max_tokens: int
    width: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    max_reqs: int
    id_bytes: int
    log_records: int = 0  # registration log capacity (0: no shared destinations)
    arena_path: str = ""  # the shared destination arena (engine/capture/shmdest.py), mapped by the rank
    arena_bytes: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def slot_layout(self) -> dict[str, tuple[int, int]]:
        """name -> (byte offset within a slot, byte length)."""
        item = torch.empty(0, dtype=self.torch_dtype).element_size()
        parts = [("header", 32), ("counts", 8 * self.max_reqs), ("starts", 8 * self.max_reqs),
                 ("placed", 8 * self.max_reqs),
                 ("pos", 8 * self.max_tokens), ("ids", 8 * self.max_tokens),
                 ("rids", self.id_bytes),
                 ("rows", item * self.n_points * self.max_tokens * self.width)]
        out, off = {}, 0
        for name, size in parts:
            out[name] = (off, size)
            off = _align(off + size)
        out["_size"] = (off, 0)
        return out

    def log_offset(self) -> int:
        return _align(CONTROL + ERROR_BYTES)

    def slots_offset(self) -> int:
        return self.log_offset() + RECORD * self.log_records

    def size(self) -> int:
        return self.slots_offset() + SLOTS * self.slot_layout()["_size"][0]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_env(cls) -> "RingSpec":
        raw = os.environ.get(RING_ENV)
        if not raw:
            raise RuntimeError(f"the capture engine asked for a step ring but {RING_ENV} is not "
                               "set in this worker: was it started by vllm.LLM() inside "
                               "VLLMModel (the mp executor spawns workers from that call)?")
        return cls(**json.loads(raw))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def new_spec(n_points: int, max_tokens: int, width: int, dtype: torch.dtype,
             max_reqs: int, arena_path: str = "", arena_bytes: int = 0) -> RingSpec:
    # vLLM's internal request id is the external one ("h<index>") plus "-<8 chars>": 64 bytes
    # per request leaves room for JSON quoting and long indices.
    path = str(Path(SHM_DIR) / f"harvest-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    # registrations between two steps: at most one per request added meanwhile; the engine adds
    # at most a step's worth (bounded by max_reqs per step in flight, a few steps' tokens), and
    # a full log only sends a request's rows through the slot (RingReader.register says so)
    log = 4 * max_reqs if arena_path else 0
    return RingSpec(path, n_points, max_tokens, width, str(dtype).replace("torch.", ""),
                    max_reqs, 64 * max_reqs + 64, log, arena_path, arena_bytes)


class _Mapped:
    def __init__(self, spec: RingSpec, create: bool):
        self.spec = spec
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(spec.path, flags, 0o600)
        try:
            if create:
                try:
                    reserve(fd, spec.size(), spec.path, "max_num_batched_tokens")
                except BaseException:
                    os.unlink(spec.path)
                    raise
            self.mm = mmap.mmap(fd, spec.size())
        finally:
            os.close(fd)
        self.layout = spec.slot_layout()
        self.slot_size = self.layout["_size"][0]
        self.base = spec.slots_offset()
        self.control = np.frombuffer(self.mm, dtype=np.int64, count=CONTROL // 8)

    def view(self, slot: int, name: str, dtype, count: int):
        off, _ = self.layout[name]
        return np.frombuffer(self.mm, dtype=dtype, count=count,
                             offset=self.base + slot * self.slot_size + off)

    def rows(self, slot: int) -> torch.Tensor:
        s = self.spec
        off, size = self.layout["rows"]
        t = torch.frombuffer(self.mm, dtype=torch.uint8, count=size,
                             offset=self.base + slot * self.slot_size + off)
        return t.view(s.torch_dtype).view(s.n_points, s.max_tokens, s.width)


class RingWriter(_Mapped):
    """The publishing rank's side (inside vLLM's worker process)."""

    def __init__(self, spec: RingSpec):
        super().__init__(spec, create=False)
        self.seq = int(self.control[0])
        self.placer = None
        if spec.arena_path:
            self.placer = Placer(self, spec.width, spec.torch_dtype)

    def publish(self, req_ids, counts, starts, fed_pos: torch.Tensor, fed_ids: torch.Tensor,
                buf: torch.Tensor | None, finished=()) -> None:
        t0 = time.perf_counter_ns()
        s, n, k = self.spec, int(fed_pos.shape[0]), len(req_ids)
        rids = json.dumps(list(req_ids)).encode()
        if k > s.max_reqs or len(rids) > s.id_bytes or n > s.max_tokens:
            self.fail(f"a step of {k} requests / {n} tokens does not fit the step ring "
                      f"({s.max_reqs} requests, {s.max_tokens} tokens)")
            return
        seq = self.seq + 1
        slot = seq % SLOTS
        self.view(slot, "counts", np.int64, k)[:] = counts
        self.view(slot, "starts", np.int64, k)[:] = starts
        self.view(slot, "pos", np.int64, n)[:] = fed_pos.cpu().numpy()
        self.view(slot, "ids", np.int64, n)[:] = fed_ids.cpu().numpy()
        off, _ = self.layout["rids"]
        at = self.base + slot * self.slot_size + off
        self.mm[at:at + len(rids)] = rids
        t1 = time.perf_counter_ns()
        placed = self.view(slot, "placed", np.int64, k)
        placed[:] = 0
        if buf is not None and n:
            self._rows(slot, req_ids, counts, starts, buf, n, placed, finished)
        t2 = time.perf_counter_ns()
        self.view(slot, "header", np.int64, 4)[:] = (seq, n, k, len(rids))
        self.seq = seq
        # where the output rank's time goes (the reader reports it: RingReader.timing)
        self.control[2:5] += (time.perf_counter_ns() - t0, t2 - t1, 1)
        self.control[0] = seq  # last: the reader trusts a slot only once this names it

    def _rows(self, slot, req_ids, counts, starts, buf, n, placed, finished) -> None:
        """Each request's rows into its registered destination (shmdest.Placer) or, if it has
        none here, into the slot's rows at their step offsets (one run per point when none is
        placed: the whole step at once)."""
        rows = self.rows(slot)
        pl = self.placer
        if pl is not None:
            pl.read_log(finished)
        if pl is None or not pl.dests:
            for p in range(buf.shape[0]):  # one contiguous run per point
                rows[p, :n].copy_(buf[p, :n])
            return
        r = 0
        for i, (rid, c, st) in enumerate(zip(req_ids, np.asarray(counts).tolist(),
                                             np.asarray(starts).tolist())):
            g = pl.place(rid, r, st, c, buf)
            if g:
                placed[i] = g
                self.control[PLACED] += c
            else:
                for p in range(buf.shape[0]):
                    rows[p, r:r + c].copy_(buf[p, r:r + c])
            r += c

    def fail(self, message: str) -> None:
        b = message.encode()[:ERROR_BYTES]
        self.mm[CONTROL:CONTROL + len(b)] = b
        self.control[1] = len(b)

    def close(self) -> None:
        if self.placer is not None:
            self.placer.close()
        self.control = None
        self.mm.close()


@dataclass
class RingStep:
    req_ids: tuple[str, ...]
    counts: np.ndarray
    starts: np.ndarray
    fed_pos: torch.Tensor
    fed_ids: torch.Tensor
    rows: torch.Tensor  # [n_points, max_tokens, width] view into the slot: valid until the next read
    n: int
    placed: np.ndarray  # int64 per request: the registration generation the rank wrote, 0: none


class RingReader(_Mapped):
    """The engine process's side: creates the file; `steps()` yields the steps not read yet."""

    def __init__(self, spec: RingSpec):
        super().__init__(spec, create=True)
        self.next = 1

    def unlink(self) -> None:
        try:
            os.unlink(self.spec.path)
        except FileNotFoundError:
            pass

    def error(self) -> str | None:
        n = int(self.control[1])
        return bytes(self.mm[CONTROL:CONTROL + n]).decode(errors="replace") if n else None

    def timing(self) -> dict:
        """The publishing rank's cumulative cost: the whole publish and its rows copy."""
        c = self.control
        return {"published": int(c[4]), "publish_s": round(int(c[2]) / 1e9, 4),
                "publish_rows_s": round(int(c[3]) / 1e9, 4), "rows_placed": int(c[PLACED])}

    def latest(self) -> int:
        return int(self.control[0])

    def skip(self) -> None:
        """Forget steps published so far (a capture starts: earlier steps are none of its rows)."""
        self.next = int(self.control[0]) + 1

    def steps(self):
        latest = int(self.control[0])
        while self.next <= latest:
            seq, slot = self.next, self.next % SLOTS
            header = self.view(slot, "header", np.int64, 4)
            if int(header[0]) != seq or latest - seq >= SLOTS:
                raise RuntimeError(
                    f"step ring overran: step {seq} was overwritten before the capture loop "
                    f"read it (latest {latest}); a step's rows would be lost")
            n, k, nb = (int(x) for x in header[1:])
            off, _ = self.layout["rids"]
            at = self.base + slot * self.slot_size + off
            rids = tuple(json.loads(bytes(self.mm[at:at + nb])))
            yield RingStep(rids, self.view(slot, "counts", np.int64, k).copy(),
                           self.view(slot, "starts", np.int64, k).copy(),
                           torch.from_numpy(self.view(slot, "pos", np.int64, n).copy()),
                           torch.from_numpy(self.view(slot, "ids", np.int64, n).copy()),
                           self.rows(slot), n, self.view(slot, "placed", np.int64, k).copy())
            self.next = seq + 1

    def close(self) -> None:
        self.control = None
        self.unlink()
        try:
            self.mm.close()
        except BufferError:  # a rows view is still alive somewhere: the mapping goes with it
            pass
