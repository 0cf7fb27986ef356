"""The capture loop's state when the runner lives in other processes (tensor parallel).

`RemoteHarvest` is a `HarvestState` without a model: the capture loop (engine/vllm_backend.py)
registers destinations, marks finished requests and hands rows over exactly as in-process; the
difference is where a step's rows come from. In-process, the runner submits each step right
after its forward. Here the output rank publishes each step to the shared-memory step ring
(engine/stepring.py) and `poll` reads every step published since the last call, then runs the
same `submit_step`: plan (coverage.plan_step), stray rows refused, positions and token ids the
model was fed compared with the request's own tokens, positions marked covered. So the checks
are the in-process ones, applied to the very values the worker ran.

Poison (the NaN check) and steering vectors are set on every worker by RPC: every rank runs the
same taps, and a steering vector must shift the replicated stream on all of them alike.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import compat
from . import taps as tapmod
from .addresses import Address
from .harvest import HarvestState
from .stepring import RingReader
from .transport import CPUTransport


class RemoteHarvest(HarvestState):
    """Constructed by VLLMModel for tensor_parallel_size > 1 (freeze mode only)."""

    def __init__(self, llm, ring: RingReader, reads, writes, width: int, dtype, max_tokens: int,
                 info: dict):
        ts = tapmod.TapSet(tuple(reads), tuple(writes), None, {}, width)
        super().__init__(ts, SimpleNamespace(report=info.get("report", {})), "freeze", max_tokens,
                         width, dtype, torch.device("cpu"), CPUTransport(), staging=False)
        self._llm, self._ring = llm, ring
        self._poison = False
        self.steer_points = frozenset(writes)

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
    def begin_capture(self, points) -> None:
        super().begin_capture(points)
        self._ring.skip()  # steps published before this capture carry none of its rows

    def poll(self, block: bool = False) -> None:
        """Read every step the workers published since the last call, then hand the copies on
        exactly as in-process (CPU copies: complete at once)."""
        err = self._ring.error()
        if err:
            raise compat.VLLMIncompatible(f"the publishing worker failed to map a step: {err}")
        for step in self._ring.steps():
            self.steps += 1
            self.scheduled_tokens += step.n
            if not (self.dests or self.retired):
                continue
            self.submit_step(step.req_ids, step.counts, step.starts, step.fed_pos, step.fed_ids,
                             step.rows)
        super().poll(block)

    def worker_summaries(self) -> list:
        return [i["summary"] if i else None for i in compat.worker_calls(self._llm, "harvest_info")]


class RemoteStats:
    """Plain mode under tensor parallel (no taps): step counts come from the output rank."""

    mode = "plain"
    layers = None

    def __init__(self, llm):
        self._llm = llm

    def _output_rank(self) -> dict:
        infos = compat.worker_calls(self._llm, "harvest_info")
        return next((i for i in infos if i and i["publishes_stats"]), infos[0])["summary"]

    def step_stats(self) -> dict:
        s = self._output_rank()
        return {k: s[k] for k in ("steps", "scheduled_tokens", "max_num_batched_tokens")}

    def summary(self) -> dict:
        return self._output_rank()
