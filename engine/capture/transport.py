"""Moving a step's rows from the tap buffer straight into each request's host destination.

One host copy: rows go from the tap buffer (device) directly into the caller's memory for that
request (a slice of the writer's shard buffer, or a fresh tensor), never through an intermediate
host tensor. A `Ticket` stands for one step's copies; the capture loop polls tickets and hands a
request over only when every ticket that wrote it has completed, so no step waits on a copy.

CPU (`CPUTransport`): the forward has finished when `execute_model` returns, so copies run inline
and tickets are complete at once.

CUDA (`CudaTransport`): copies run on a side stream, ordered after the forward by an event, into
pinned host memory (a copy into pageable memory would synchronise the host). Two hazards and how
they are closed:
- the next forward overwrites the tap buffer and the runner's fed positions/token ids. With
  `staging` (default) the main stream first copies the step's rows device-to-device into one of
  two staging buffers (~0.1 ms per GB on HBM) and the side stream reads the staging buffer, so the
  next forward overlaps the host copy; a staging buffer is reused two steps later, after the
  main stream waited for the copy that read it. Without staging the main stream waits for the
  previous copy at the start of the next step: half the memory, but the device idles for the
  copy's duration.
- a host destination is written asynchronously: the capture loop must not hand it over, and the
  caller must not reuse it, until its ticket completes (harvest.HarvestState enforces the first;
  the capture contract states the second).

Quantised capture (`quantize=True`, fp8 stores): a step's rows are quantised (engine/capture/quantize.py)
on the rows' device before any copy leaves it; the packed rows (`W + 4` bytes per row instead of
`2W`) are what the device-to-host copy, the host buffers and everything after carry. On CUDA the
quantiser writes into one of two packed stage buffers on the main stream (it is the staging copy:
the next forward may overwrite the tap buffer at once), and the side stream copies from there.

Device memory: the tap buffer `P x max_tokens x W x itemsize`, plus twice that with staging
(quantised: two packed stages of `P x max_tokens x (W + 4)` bytes instead).
Host memory per step in flight: `n x 12` bytes of fed positions and token ids (pinned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .coverage import StepPlan
from .quantize import packed_width, quantize_points


@dataclass
class Ticket:
    """One step's copies: complete when `done` is (None: complete at creation)."""

    plan: StepPlan
    fed_positions: torch.Tensor  # host
    fed_ids: torch.Tensor  # host
    done: Any = None
    rids: tuple[str, ...] = ()

    def fed(self) -> tuple[np.ndarray, np.ndarray]:
        return self.fed_positions.numpy(), self.fed_ids.numpy()


def copy_segment(dest: torch.Tensor, src: torch.Tensor, slots: Sequence[int], seg,
                 non_blocking: bool) -> None:
    """dest[i, start:start+c] = src[slots[i], row:row+c] for each requested point i.

    One copy per point: each side is a contiguous run of `c x width` values, so a device-to-host
    copy is a single memcpy into the (pinned) destination; copying the whole [P, c, W] block at
    once would be strided on both sides, and torch stages such a copy through a pageable host
    temporary, which synchronises and adds the second host copy this module exists to avoid.
    """
    d0, d1, s0, s1 = seg.start, seg.start + seg.count, seg.row, seg.row + seg.count
    if not non_blocking and _is_range(slots):
        a = slots[0] if slots else 0
        dest[:, d0:d1].copy_(src[a : a + len(slots), s0:s1])
        return
    for i, s in enumerate(slots):
        dest[i, d0:d1].copy_(src[s, s0:s1], non_blocking=non_blocking)


def _is_range(slots: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(slots, slots[1:]))


def check_destination(t: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype,
                      need_pinned: bool) -> torch.Tensor:
    """Refuse a destination the copies would write wrongly or slowly (names the fix)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a destination must be a torch.Tensor [points, tokens, width], got "
                        f"{type(t).__name__}; wrap numpy memory with torch.from_numpy")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"destination shape {tuple(t.shape)} != {tuple(shape)} "
                         "(captured points, the request's tokens, model width)")
    if t.dtype != dtype:
        raise ValueError(f"destination dtype {t.dtype} != engine dtype {dtype}; for bf16 rows "
                         "held as raw int16 pass torch.from_numpy(raw).view(torch.bfloat16)")
    if t.device.type != "cpu":
        raise ValueError(f"destination is on {t.device}: rows go to host memory")
    if t.shape[1] and (t.stride(2) != 1 or (t.shape[1] > 1 and t.stride(1) != t.shape[2])):
        raise ValueError("each point's rows must be one contiguous [tokens, width] block "
                         f"(strides {t.stride()}); a slice [:, a:b] of a [P, rows, W] buffer is")
    if need_pinned and not t.is_pinned():
        raise ValueError("on CUDA a destination must be pinned host memory: a copy into pageable "
                         "memory synchronises every step. Allocate the buffer with "
                         "torch.empty(..., pin_memory=True) (its .numpy() is a view)")
    return t


class CPUTransport:
    """The forward is synchronous: copy now, complete now."""

    pinned = False

    def before_forward(self) -> None:
        pass

    def new_destination(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def submit(self, plan: StepPlan, buf: torch.Tensor, slots: Sequence[int], fed_positions,
               fed_ids, dests: Mapping[str, torch.Tensor], quantize: bool = False) -> Ticket:
        t = self.delivered(plan, fed_positions, fed_ids)
        if quantize:   # the packed rows of exactly the captured points, in their order
            out = torch.empty(len(slots), plan.n, packed_width(buf.shape[-1]), dtype=torch.uint8)
            buf, slots = quantize_points(buf, slots, plan.n, out), range(len(slots))
        for seg in plan.segments:
            copy_segment(dests[seg.rid], buf, slots, seg, non_blocking=False)
        return t

    def delivered(self, plan: StepPlan, fed_positions, fed_ids) -> Ticket:
        """A step's ticket once its rows are in the destinations (copied by `submit`, or written by
        the taps themselves: direct.py). The runner reuses its fed buffers next step: keep this
        step's values."""
        return Ticket(plan, fed_positions.clone(), fed_ids.clone(),
                      rids=tuple(s.rid for s in plan.segments))

    def ready(self, t: Ticket) -> bool:
        return True

    def wait(self, t: Ticket) -> None:
        pass


class CudaTransport:
    """Side-stream device-to-host copies ordered by events (see the module docstring)."""

    pinned = True

    def __init__(self, buf: torch.Tensor, fed_len: int, staging: bool = True):
        self.device = buf.device
        self.stream = torch.cuda.Stream(device=self.device)
        self.staging = staging
        self._stages: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if staging:
            for _ in range(2):
                self._stages.append((
                    torch.empty_like(buf),
                    torch.empty(fed_len, dtype=torch.int64, device=self.device),
                    torch.empty(fed_len, dtype=torch.int32, device=self.device)))
        self._stage_free: list = [None, None]  # copy event that last read each stage
        self._qstages: list[torch.Tensor] = []  # packed fp8 stages, made by the first quantised step
        self._qfree: list = [None, None]
        self._qk = 0
        self._k = 0
        self._last = None

    def before_forward(self) -> None:
        if not self.staging and self._last is not None:
            # the forward rewrites the tap buffer and the fed inputs the last copy reads
            torch.cuda.current_stream(self.device).wait_event(self._last)

    def new_destination(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def submit(self, plan: StepPlan, buf: torch.Tensor, slots: Sequence[int], fed_positions,
               fed_ids, dests: Mapping[str, torch.Tensor], quantize: bool = False) -> Ticket:
        n = plan.n
        main = torch.cuda.current_stream(self.device)
        src, pos, ids = buf, fed_positions, fed_ids
        qk = None
        if quantize:
            # quantised on the main stream into a packed stage, before anything leaves the
            # device; the stage is reused two steps later, after the copy that read it
            shape = (len(slots), buf.shape[1], packed_width(buf.shape[-1]))
            if not self._qstages or tuple(self._qstages[0].shape) != shape:
                self._qstages = [torch.empty(shape, dtype=torch.uint8, device=self.device)
                                 for _ in range(2)]
                self._qfree = [None, None]
            qk = self._qk
            self._qk ^= 1
            if self._qfree[qk] is not None:
                main.wait_event(self._qfree[qk])
            src = quantize_points(buf, slots, n, self._qstages[qk])
            slots = range(len(slots))
        if self.staging:
            k = self._k
            self._k ^= 1
            if self._stage_free[k] is not None:
                main.wait_event(self._stage_free[k])
            stage, pos, ids = self._stages[k]
            if qk is None:
                src = stage
                src[:, :n].copy_(buf[:, :n])
            pos, ids = pos[:n], ids[:n]
            pos.copy_(fed_positions)
            ids.copy_(fed_ids.to(torch.int32))
        forward_done = torch.cuda.Event()
        forward_done.record(main)
        host_pos = torch.empty(n, dtype=torch.int64, pin_memory=True)
        host_ids = torch.empty(n, dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(forward_done)
            host_pos.copy_(pos, non_blocking=True)
            host_ids.copy_(ids, non_blocking=True)
            for seg in plan.segments:
                copy_segment(dests[seg.rid], src, slots, seg, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        if self.staging:
            self._stage_free[k] = done
        if qk is not None:
            self._qfree[qk] = done
        self._last = done
        return Ticket(plan, host_pos, host_ids, done, tuple(s.rid for s in plan.segments))

    def ready(self, t: Ticket) -> bool:
        return t.done is None or t.done.query()

    def wait(self, t: Ticket) -> None:
        if t.done is not None:
            t.done.synchronize()


def make_transport(buf: torch.Tensor | None, fed_len: int, staging: bool = True
                   ) -> CPUTransport | CudaTransport:
    if buf is not None and buf.device.type == "cuda":
        return CudaTransport(buf, fed_len, staging)
    return CPUTransport()
