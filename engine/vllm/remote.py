"""The capture loop's state when the runner lives in other processes (tensor parallel).

`RemoteHarvest` is a `HarvestState` without a model: the capture loop (engine/vllm/backend.py)
registers destinations, marks finished requests and hands rows over exactly as in-process; the
difference is where a step's rows come from. In-process, the runner submits each step right
after its forward. Here the output rank publishes each step to the shared-memory step ring
(engine/capture/stepring.py) and `poll` reads every step published since the last call, then plans it
as in-process: plan (coverage.plan_step), stray rows refused, positions and token ids the model
was fed compared with the request's own tokens, positions marked covered. So the checks are the
in-process ones, applied to the very values the worker ran.

Rows of a request whose destination lies in the shared arena (engine/capture/shmdest.py) were written
there by the rank itself (one host copy); the step says under which registration, and a
mismatch with the request's own registration fails the capture. The other requests' rows are
copied from the step's slot (one extra copy).

Poison (the NaN check) and steering vectors are set on every worker by RPC: every rank runs the
same taps, and a steering vector must shift the replicated stream on all of them alike.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch

from . import compat
from ..capture import taps as tapmod
from ..addresses import Address
from ..capture.coverage import CoverageError
from .messages import WorkerInfo
from .rowmap import HarvestState
from ..capture.shmdest import Registrations, SharedArena
from ..capture.stepring import RingReader, RingStep, new_spec
from ..capture.transport import CPUTransport, Ticket, copy_segment


# the shared destination arena's least default size (reserved in /dev/shm at engine load)
SHARED_MIN = 256 << 20


def open_rows_path(n_points: int, max_tokens: int, width: int, dtype: torch.dtype, max_seqs: int,
                   shared_bytes: int | None) -> tuple[RingReader, SharedArena | None]:
    """The step ring and the shared destination arena of a tensor-parallel freeze engine, made
    before vLLM starts the ranks. The arena holds the writers' block buffers: by default 8 full
    steps of rows, at least SHARED_MIN; 0 turns it off (every row through the ring's slots)."""
    if shared_bytes is None:
        item = torch.empty(0, dtype=dtype).element_size()
        shared_bytes = max(SHARED_MIN, 8 * n_points * max_tokens * width * item)
    arena = SharedArena(shared_bytes) if shared_bytes else None
    try:
        ring = RingReader(new_spec(n_points, max_tokens, width, dtype, max_seqs,
                                   arena.path if arena else "", arena.size if arena else 0))
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    return ring, arena


class RemoteHarvest(HarvestState):
    """Constructed by VLLMModel for tensor_parallel_size > 1 (freeze mode only)."""

    def __init__(self, llm, ring: RingReader, reads, writes, width: int, dtype, max_tokens: int,
                 info: WorkerInfo, arena: SharedArena | None = None):
        ts = tapmod.TapSet(tuple(reads), tuple(writes), None, {}, width)
        super().__init__(ts, SimpleNamespace(report=info.report), "freeze", max_tokens,
                         width, dtype, torch.device("cpu"), CPUTransport(), staging=False)
        self._llm, self._ring = llm, ring
        self._poison = False
        self.steer_points = frozenset(writes)
        self.read_s = 0.0  # the capture loop's side of the ring: plan, checks, copy out
        self.arena = arena
        self._regs = Registrations(ring) if arena is not None else None
        self._gens: dict[str, int] = {}  # request -> its registration with the rank
        self._placeable = False
        self.rows_placed = self.rows_copied = 0

    # -- set on the workers -------------------------------------------------------------------
    @property
    def poison(self) -> bool:
        return getattr(self, "_poison", False)

    @poison.setter
    def poison(self, on: bool) -> None:
        if not hasattr(self, "_llm"):  # the dataclass __init__ sets the default first
            return
        self._poison = bool(on)
        compat.worker_calls(self._llm, "harvest_set_poison", bool(on))

    def set_steer(self, a: Address, vec: torch.Tensor) -> None:
        compat.worker_calls(self._llm, "harvest_set_steer", str(a), vec.float().tolist())

    # -- capture loop side ----------------------------------------------------------------------
    def begin_capture(self, points, quantize: str | None = None) -> None:
        if quantize is not None:
            raise ValueError(f"quantize={quantize!r}: a tensor-parallel engine hands rows over "
                             "through the step ring unquantised; quantise on the host (the "
                             "store's writer does, bit for bit the same) or use "
                             "tensor_parallel_size 1")
        super().begin_capture(points)
        self._ring.skip()  # steps published before this capture carry none of its rows
        # the rank writes its tap buffer's points in tap order (shmdest.Placer): a capture of
        # another selection keeps its slot mapping here and copies from the step ring
        self._placeable = (self._regs is not None
                           and self.slots == tuple(range(len(self.taps.reads))))

    def register(self, rid: str, acts: torch.Tensor, tokens, known: int | None = None) -> None:
        """As in-process; a destination in the shared arena is also registered with the rank
        (before vLLM can schedule the request: the caller adds it to vLLM after this)."""
        super().register(rid, acts, tokens, known)
        off = self.arena.offset_of(acts) if self._placeable else None
        if off is not None:
            gen = self._regs.add(rid, off, len(tokens), acts.stride(0) * acts.element_size())
            if gen:
                self._gens[rid] = gen

    def take(self, rid: str, what: str) -> torch.Tensor:
        self._gens.pop(rid, None)
        return super().take(rid, what)

    def wait_all_and_drop(self, rids) -> None:
        super().wait_all_and_drop(rids)
        for rid in rids:
            self._gens.pop(rid, None)

    def poll(self, block: bool = False) -> None:
        """Read every step the workers published since the last call, then hand the copies on
        exactly as in-process (CPU copies: complete at once)."""
        err = self._ring.error()
        if err:
            raise compat.VLLMIncompatible(f"the publishing worker failed to map a step: {err}")
        t0 = time.perf_counter()
        for step in self._ring.steps():
            self.steps += 1
            self.scheduled_tokens += step.n
            if not (self.dests or self.retired):
                continue
            self._submit(step)
        super().poll(block)
        self.read_s += time.perf_counter() - t0

    def _submit(self, step: RingStep) -> None:
        """HarvestState.submit_step for a step read from the ring: the same plan and stray-row
        refusal; rows the rank placed are checked against the request's registration, the
        others are copied from the slot. Fed tokens and coverage are checked in `poll` as
        in-process (the ticket is complete at once: the rank finished before it published)."""
        plan = self.plan_rows(step.req_ids, step.counts, step.starts)
        if plan is None:
            return
        placed = dict(zip(step.req_ids, step.placed.tolist()))
        for seg in plan.segments:
            gen = placed.get(seg.rid, 0)
            if gen == 0:
                copy_segment(self.dests[seg.rid].acts, step.rows, self.slots, seg,
                             non_blocking=False)
                self.rows_copied += seg.count
            elif gen != self._gens.get(seg.rid):
                raise CoverageError(
                    f"request {seg.rid!r}: the tensor-parallel rank wrote its rows under "
                    f"registration {gen}, but its destination is registration "
                    f"{self._gens.get(seg.rid)}: the rows went to memory that is not this "
                    "request's (a stale or overwritten registration)")
            else:
                self.rows_placed += seg.count
        self.enqueue(plan, Ticket(plan, step.fed_pos, step.fed_ids,
                                  rids=tuple(s.rid for s in plan.segments)))

    def step_stats(self) -> dict:
        return {**super().step_stats(), "rows_placed": self.rows_placed}

    def summary(self) -> dict:
        """The in-process summary plus where the rows' path spends its time (`ring`: the
        output rank's publish and its rows copy, this process's read, checks and copy out)."""
        arena = ({"allocated": self.arena.allocated, "fallbacks": self.arena.fallbacks}
                 if self.arena is not None else None)
        return {**super().summary(), "rows_placed": self.rows_placed,
                "rows_copied": self.rows_copied, "arena": arena,
                "ring": {**self._ring.timing(), "read_s": round(self.read_s, 4)}}

    def worker_summaries(self) -> list:
        return [i.summary if i else None for i in compat.worker_calls(self._llm, "harvest_info")]


class RemoteStats:
    """Plain mode under tensor parallel (no taps): step counts come from the output rank."""

    mode = "plain"
    layers = None

    def __init__(self, llm):
        self._llm = llm

    def _output_rank(self) -> dict[str, Any]:
        """The output rank's capture summary."""
        infos = compat.worker_calls(self._llm, "harvest_info")
        return next((i for i in infos if i and i.publishes_stats), infos[0]).summary

    def step_stats(self) -> dict:
        s = self._output_rank()
        return {k: s[k] for k in ("steps", "scheduled_tokens", "max_num_batched_tokens")}

    def summary(self) -> dict:
        return self._output_rank()
