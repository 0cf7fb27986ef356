"""Runner-side capture state: taps installed at model load, a step's rows moved out after it runs.

`HarvestState` is owned by the model runner (engine/vllm/runner.py) and reached by the capture loop in
the same process through one worker call; there is no module-level state. Per step:

1. `before_forward`: make the tap buffer safe to overwrite (transport) and, in the NaN check,
   poison it so a row no tap wrote cannot pass for data. On a CPU engine, arm the taps to write
   this step's rows straight into the destinations (engine/capture/direct.py).
2. `after_forward`: read the step's layout from the runner (compat.step_layout: request order,
   counts, first positions), plan where each row goes (coverage.plan_step), and submit one
   ticket of copies straight into the requests' destinations (transport); when the taps
   already delivered the rows, check they used this same plan and that every captured
   point's tap ran, and submit the ticket with nothing left to copy.
3. `poll` (capture loop): for each completed ticket, compare the positions and token ids the
   runner fed with the requests' own tokens (coverage.check_fed) and mark the positions covered.
   A request is final when vLLM finished it and no ticket that writes it is outstanding.

Errors found inside the runner are recorded and raised by the capture loop after the step:
raising inside vLLM's `execute_model` would leave its engine half-way through a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from . import compat
from ..capture import taps as tapmod
from . import probe as vllm_probe
from .scorestep import ScoreStep
from .tpshards import ShardGather, plan as shard_plan
from ..addresses import Address, FreezeSet
from ..points import LOGIT_POINTS, PACKED
from ..protocol import CaptureMode
from ..capture.stepring import RingSpec, RingWriter
from ..capture.coverage import Coverage, CoverageError, check_fed, plan_step, require_no_stray
from ..capture.direct import ARMED, DIRECT, IDLE, Delivery, Sink
from ..capture.quantize import check_quantize, packed_width
from ..capture.block_stream import Trunk
from ..capture.transport import CPUTransport, CudaTransport, check_destination, make_transport


@dataclass
class Dest:
    """One registered request: where its rows go and which of its positions have arrived."""

    acts: torch.Tensor  # [points of this capture, n, width], host
    tokens: np.ndarray  # int32 [n]: the prompt, then generated tokens as vLLM reports them
    coverage: Coverage
    known: int = 0  # tokens[:known] are known (a prompt: all; a generation grows, see extend)
    rows: int | None = None  # positions handed over; None: all n (set when a generation ends)
    pending: int = 0  # submitted tickets that write into acts and are not processed yet
    finished: bool = False  # vLLM reported the request finished


@dataclass
class HarvestState:
    taps: tapmod.TapSet
    # the probed trunk (freeze and hooked modes); None in plain mode; on the capture side of tensor
    # parallel (remote.py) a namespace holding the ranks' probe report
    layers: Trunk | SimpleNamespace | None
    mode: CaptureMode
    max_tokens: int
    width: int
    dtype: torch.dtype
    device: torch.device
    transport: CPUTransport | CudaTransport
    staging: bool = True
    dests: dict[str, Dest] = field(default_factory=dict)
    retired: set = field(default_factory=set)  # aborted internal ids: their rows are dropped
    # (step, id) of generated requests handed over: under async scheduling vLLM may already run
    # one more decode step of a request whose stop token it has not seen yet; that row is dropped
    # like an aborted one's, and the id leaves `retired` a few steps later (bounded memory)
    lingering: deque = field(default_factory=deque)
    slots: tuple[int, ...] = ()
    tickets: deque = field(default_factory=deque)
    error: BaseException | None = None
    poison: bool = False  # NaN-fill the tap buffer before every forward (checks)
    hook_handles: list = field(default_factory=list)
    steps: int = 0
    scheduled_tokens: int = 0
    rows: int = 0
    rewrites: int = 0
    dropped_rows: int = 0
    ring: "RingWriter | None" = None  # tensor parallel: this rank publishes steps (stepring.py)
    quantize: bool = False  # this capture's rows leave the engine as packed fp8 (quantize.py)
    geometry: dict = field(default_factory=dict)  # compat.runner_geometry (hooked mode's widths)
    shards: "ShardGather | None" = None  # tensor parallel: sharded slots assembled (tpshards.py)
    sink: Sink | None = None  # CPU freeze engines: taps deliver rows themselves (direct.py)
    direct_steps: int = 0  # steps whose rows the taps delivered
    scores: "ScoreStep | None" = None  # logprob.0 / entropy.0 read: computed after each forward

    # -- capture loop side ------------------------------------------------------------------
    def begin_capture(self, points: tuple[Address, ...], quantize: str | None = None) -> None:
        """Start a capture of `points`; `quantize="float8_e4m3fn"`: rows are quantised on the
        device before they leave it (destinations are then uint8 [points, n, width + 4])."""
        if self.dests or self.tickets:
            raise RuntimeError("a capture is already running on this engine; finish or close it "
                               "first (one capture at a time per engine)")
        self.quantize = check_quantize(quantize) is not None
        packed = sorted({a.name for a in points if a.name in PACKED})
        if self.quantize and packed:
            raise ValueError(f"{', '.join(packed)} are float32/int32 values, not activations: "
                             "fp8 would destroy them; capture them without quantize (an fp8 "
                             "store: store.dtype bfloat16, or leave them out of capture.points)")
        self.error = None
        if self.mode == "hooked":
            self._set_hooked_points(points)
        self.slots = tuple(self.taps.slot(a) for a in points)

    def destination(self, acts: torch.Tensor | None, n: int) -> torch.Tensor:
        shape = (len(self.slots), n, packed_width(self.width) if self.quantize else self.width)
        dtype = torch.uint8 if self.quantize else self.dtype
        if acts is None:
            return self.transport.new_destination(shape, dtype)
        return check_destination(acts, shape, dtype, self.transport.pinned)

    def register(self, rid: str, acts: torch.Tensor, tokens: np.ndarray,
                 known: int | None = None) -> None:
        """`tokens` has room for every position of the request; the first `known` are its
        prompt (default: all of them, a prompt capture)."""
        n = len(tokens)
        self.dests[rid] = Dest(acts, tokens, Coverage(n), n if known is None else known)

    def extend(self, rid: str, new_ids) -> None:
        """Tokens vLLM sampled for a generated request, in order: the rows of positions up to
        `known` can now be checked against what the runner fed (tickets wait until then)."""
        d = self.dests[rid]
        k = len(new_ids)
        if d.known + k > len(d.tokens):
            raise CoverageError(f"request {rid!r}: vLLM reported {d.known + k} tokens, more than "
                                f"the {len(d.tokens)} positions registered for it")
        d.tokens[d.known : d.known + k] = new_ids
        d.known += k

    def end_rows(self, rid: str, rows: int) -> None:
        """A generated request finished: positions [0, rows) are handed over (the last sampled
        token is never fed, so it has no row; see engine/vllm/generate.py)."""
        self.dests[rid].rows = rows

    def mark_finished(self, rid: str) -> None:
        self.dests[rid].finished = True

    def is_final(self, rid: str) -> bool:
        d = self.dests[rid]
        return d.finished and d.pending == 0

    def take(self, rid: str, what: str) -> torch.Tensor:
        """Hand a final request's rows over: from here the caller owns them, the engine never
        writes them again (the request id is retired in vLLM and here)."""
        d = self.dests[rid]
        if not self.is_final(rid):
            raise RuntimeError(f"{what}: handed over before its rows are final")
        d.coverage.require_complete(what, d.rows)
        del self.dests[rid]
        self.rows += d.coverage.n if d.rows is None else d.rows
        if d.rows is not None:
            self.retired.add(rid)
            self.lingering.append((self.steps, rid))
        self.rewrites += d.coverage.rewrites
        return d.acts

    def poll(self, block: bool = False) -> None:
        """Process completed tickets in submission order (one stream: they complete in order)."""
        while self.tickets:
            t = self.tickets[0]
            if not self._tokens_known(t):
                # a decode row whose fed token vLLM has not reported yet (async scheduling): the
                # check waits for the output; with no step left to run that output never comes
                if block:
                    raise CoverageError("a step fed generated tokens that vLLM never reported: "
                                        "the rows cannot be checked against their tokens")
                return
            if not self.transport.ready(t):
                if not block:
                    return
                self.transport.wait(t)
            self.tickets.popleft()
            self._process(t)

    def wait_all_and_drop(self, rids) -> None:
        """Abort path: let every outstanding copy finish (they write into caller memory), then
        forget these requests; rows vLLM still runs for them later are dropped, not copied."""
        for t in self.tickets:
            self.transport.wait(t)
        self.tickets.clear()
        for rid in rids:
            self.dests.pop(rid, None)
            self.retired.add(rid)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def _tokens_known(self, t) -> bool:
        return all(s.start + s.count <= self.dests[s.rid].known for s in t.plan.segments)

    def _process(self, t) -> None:
        pos, ids = t.fed()
        try:
            check_fed(t.plan, pos, ids, {s.rid: self.dests[s.rid].tokens for s in t.plan.segments})
        finally:
            for s in t.plan.segments:
                d = self.dests[s.rid]
                d.pending -= 1
        for s in t.plan.segments:
            self.dests[s.rid].coverage.mark(s.start, s.count)

    # -- runner side ------------------------------------------------------------------------
    def before_forward(self, runner=None, scheduler_output=None) -> None:
        self.transport.before_forward()
        if self.scores is not None and scheduler_output is not None:
            self.scores.track(scheduler_output)
        if self.poison and self.taps.buf is not None:
            self.taps.buf.fill_(float("nan"))
        if (self.sink is not None and runner is not None and not self.quantize and not self.poison
                and self.error is None and (self.dests or self.retired)):
            self.sink.arm(lambda: self._plan_now(runner, scheduler_output), self.slots)

    def _plan_now(self, runner, scheduler_output):
        """At the step's first tap (direct.py): the layout vLLM prepared for this forward and
        where its rows go; raising makes the step fall back to the buffer path."""
        lay = compat.step_layout(runner, scheduler_output)
        plan = self._plan(lay.req_ids, lay.counts, lay.starts)
        return (lay.req_ids, lay.counts, lay.starts), plan, {
            s.rid: self.dests[s.rid].acts for s in plan.segments}

    def _finish_direct(self, d: Delivery, lay, fed_pos, fed_ids) -> None:
        """The taps delivered this step's rows: the plan they used must be the step's, and every
        captured point's tap must have run; then a ticket with nothing left to copy."""
        req_ids, counts, starts = d.layout if d.layout is not None else ((), (), ())
        if d.state == ARMED or req_ids != lay.req_ids or not (
                np.array_equal(counts, lay.counts) and np.array_equal(starts, lay.starts)):
            what = "no tap ran during the forward" if d.state == ARMED else (
                "the runner's batch changed between the step's first tap and the end of its forward")
            raise CoverageError(f"a step's rows were not delivered: {what} (requests {lay.req_ids[:4]}"
                                f"{' ...' if len(lay.req_ids) > 4 else ''}); refusing rows that may "
                                "sit at the wrong positions")
        plan = d.plan
        assert plan is not None and isinstance(self.transport, CPUTransport)  # DIRECT: planned, on CPU
        missing = [self.taps.reads[s] for s in self.slots if not d.calls.get(s)]
        if missing and plan.segments:
            raise CoverageError(f"the taps of {', '.join(map(str, missing[:4]))} did not run in a "
                                "step's forward: their rows were never written")
        self.dropped_rows += plan.dropped
        self.direct_steps += 1
        if plan.segments:
            self.enqueue(plan, self.transport.delivered(plan, fed_pos, fed_ids))

    def after_forward(self, runner, scheduler_output) -> None:
        if self.scores is not None:   # every rank alike (a collective), before any row moves
            self._write_scores(runner, scheduler_output)
        delivery = self.sink.disarm() if self.sink is not None and self.sink.state != IDLE else None
        self.steps += 1
        self.scheduled_tokens += compat.scheduled_tokens(scheduler_output)
        while self.lingering and self.lingering[0][0] < self.steps - 4:
            self.retired.discard(self.lingering.popleft()[1])
        if self.shards is not None:  # every rank, every step: sharded slots become full rows
            self.shards.gather(self.taps.buf, compat.scheduled_tokens(scheduler_output))
        if self.ring is not None:
            self._publish(runner, scheduler_output)
            return
        if self.taps.buf is None or self.error is not None or not (self.dests or self.retired):
            return
        try:
            lay = compat.step_layout(runner, scheduler_output)
            fed_pos, fed_ids = compat.fed_inputs(runner, lay.n)
            if delivery is not None and delivery.state in (ARMED, DIRECT):
                self._finish_direct(delivery, lay, fed_pos, fed_ids)
            else:
                self.submit_step(lay.req_ids, lay.counts, lay.starts, fed_pos, fed_ids, self.taps.buf)
        except (CoverageError, compat.VLLMIncompatible, KeyError, ValueError) as e:
            self.error = e

    def _write_scores(self, runner, scheduler_output) -> None:
        """logprob.0 / entropy.0 of this step's rows into their tap slots, through the tap op
        (so an armed CPU sink delivers them straight to the destinations, like every tap)."""
        buf = self.taps.buf
        try:
            lay = compat.step_layout(runner, scheduler_output)
            self.scores.run(runner, lay, lambda x, slot: torch.ops.harvest.tap(x, buf, slot))
        except (compat.VLLMIncompatible, KeyError, ValueError) as e:
            if self.ring is not None:   # the capture loop is in another process: it must know
                self.ring.fail(f"{type(e).__name__}: {e}")
            else:
                self.error = e

    def _publish(self, runner, scheduler_output) -> None:
        """Tensor parallel, the output rank: every step goes to the step ring, whatever the
        capture loop registered (it lives in another process); the loop plans and checks it."""
        try:
            lay = compat.step_layout(runner, scheduler_output)
            fed_pos, fed_ids = compat.fed_inputs(runner, lay.n)
            self.ring.publish(lay.req_ids, lay.counts, lay.starts, fed_pos, fed_ids, self.taps.buf,
                              compat.finished_req_ids(scheduler_output))
        except (compat.VLLMIncompatible, KeyError, ValueError) as e:
            self.ring.fail(f"{type(e).__name__}: {e}")

    def submit_step(self, req_ids, counts, starts, fed_pos, fed_ids, buf) -> None:
        """Plan one step's rows (request order, counts, first positions as the runner ran
        them), refuse stray rows and submit the copies from `buf` into the destinations. The
        in-process runner calls it after each forward; across processes (tensor parallel) the
        capture loop plans a step read from the step ring the same way (engine/vllm/remote.py)."""
        plan = self.plan_rows(req_ids, counts, starts)
        if plan is None:
            return
        dests = {s.rid: self.dests[s.rid].acts for s in plan.segments}
        kw = {"quantize": True} if self.quantize else {}   # transports without it never quantise
        self.enqueue(plan, self.transport.submit(plan, buf, self.slots, fed_pos, fed_ids, dests, **kw))

    def plan_rows(self, req_ids, counts, starts):
        """A step's row plan, stray rows refused and dropped rows counted; None when the step
        has no row to deliver (only dropped rows: nothing to copy, no ticket to wait for)."""
        plan = self._plan(req_ids, counts, starts)
        self.dropped_rows += plan.dropped
        return plan if plan.segments else None

    def _plan(self, req_ids, counts, starts):
        """Where a step's rows go (coverage.plan_step over the registered requests), stray rows
        refused."""
        lengths = {rid: d.coverage.n for rid, d in self.dests.items()}
        plan = plan_step(req_ids, counts, starts, lengths, self.retired)
        require_no_stray(plan)
        return plan

    def enqueue(self, plan, ticket) -> None:
        """Hold a planned step's ticket until its copies land: each request it writes to has
        one more copy pending (take/wait_all_and_drop wait for them)."""
        for s in plan.segments:
            self.dests[s.rid].pending += 1
        self.tickets.append(ticket)

    def _set_hooked_points(self, points: tuple[Address, ...]) -> None:
        """Hooked mode serves any point: (re)install Python hooks for exactly these."""
        for h in self.hook_handles:
            h.remove()
        self.hook_handles = []
        buf = None
        widths = vllm_probe.read_widths(points, self.geometry)
        self.width = tapmod.buffer_width(self.geometry["width"], widths)
        if points:
            buf = torch.zeros(len(points), self.max_tokens, self.width, dtype=self.dtype,
                              device=self.device)
        self.taps = tapmod.TapSet(tuple(points), (), buf, {}, self.width, widths)
        self.transport = make_transport(buf, self.max_tokens, staging=False)
        self.scores = score_step(self.taps, self.geometry)
        if points:
            assert isinstance(self.layers, Trunk), "hooked mode taps the probed trunk"
            self.hook_handles = tapmod.install_hooks(self.layers, self.taps)

    def step_stats(self) -> dict:
        return {"steps": self.steps, "scheduled_tokens": self.scheduled_tokens,
                "max_num_batched_tokens": self.max_tokens}

    def summary(self) -> dict:
        return {**self.step_stats(), "mode": self.mode, "rows": self.rows,
                "rewrites": self.rewrites, "dropped_rows": self.dropped_rows,
                "transport": type(self.transport).__name__, "staging": self.staging,
                "direct_steps": self.direct_steps,
                **(self.shards.summary() if self.shards is not None else {})}


def score_step(taps: tapmod.TapSet, geometry: dict) -> "ScoreStep | None":
    """The runner's score computation when `taps` reads logprob.0 or entropy.0, else None."""
    slots = {a.name: taps.slot(a) for a in taps.reads if a.name in LOGIT_POINTS}
    return ScoreStep(slots, geometry["vocab"], geometry["dtype"]) if slots else None


def setup(runner, cfg: dict) -> HarvestState:
    """Called from the runner's load_model, after the weights load and before vLLM compiles."""
    if compat.microbatched(runner.vllm_config) and cfg["mode"] != "plain":
        raise compat.VLLMIncompatible(
            "vLLM is set to run each step in micro-batches (enable_dbo / ubatch_size > 1): the "
            "taps of one slice would overwrite the rows of the one before; turn it off to capture")
    g = compat.runner_geometry(runner)
    mode = cfg["mode"]
    staging = bool(cfg.get("staging", True))
    layers = None
    if mode == "freeze":
        model = runner.get_model()
        # i13: the block-semantics probe (refuses a trunk it cannot verify) before any tap.
        layers = vllm_probe.probed_trunk(runner, model, g["n_layers"], cfg)
        fs = FreezeSet(tuple(map(Address.parse, cfg["reads"])), tuple(map(Address.parse, cfg["writes"])))
        # full widths: under TP the ranks assemble sharded points in place (tpshards.py)
        ts = tapmod.allocate(fs, g["max_tokens"], g["width"], g["dtype"], g["device"],
                             vllm_probe.read_widths(fs.reads, g, full=True))
        # The single call into taps (i13 owns its arguments): wrap the decoder layers now, so the
        # compiled graph contains the taps.
        tapmod.install_freeze(layers, ts)
    else:  # hooked: buffers per capture call; plain: no taps, steps counted
        if mode == "hooked":
            layers = vllm_probe.probed_trunk(runner, runner.get_model(), g["n_layers"], cfg)
        ts = tapmod.TapSet((), (), None, {}, g["width"])
    transport = make_transport(ts.buf, g["max_tokens"], staging=staging)
    st = HarvestState(ts, layers, mode, g["max_tokens"], max(g["width"], ts.width), g["dtype"],
                      g["device"], transport, staging, geometry=g, scores=score_step(ts, g))
    par = compat.parallel_ranks()
    if (mode == "freeze" and ts.buf is not None and isinstance(transport, CPUTransport)
            and par["tp_size"] == 1 and not cfg.get("ring")):
        st.sink = Sink(ts.buf)
    if par["tp_size"] > 1 and mode == "freeze" and ts.buf is not None:
        # Every rank computed the same probe and installed the same taps (so every rank compiles
        # the same graph); a point whose value differs between ranks is a shard, refused here.
        vllm_probe.require_replicated(runner, model, layers, fs.reads, g["n_layers"])
        st.shards = shard_plan(layers, fs.reads, g, par["tp_rank"], par["tp_size"])
    if cfg.get("ring") and par["output_rank"]:
        spec = RingSpec.from_env()
        if ts.buf is not None and ts.buf.shape[-1] != spec.width:
            raise compat.VLLMIncompatible(
                f"the step ring's rows are {spec.width} wide but this rank's tap buffer is "
                f"{ts.buf.shape[-1]}: the engine and the rank disagree on the points' widths")
        st.ring = RingWriter(spec)
    return st
