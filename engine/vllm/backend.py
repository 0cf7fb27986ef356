"""vLLM backend: plain, hooked (enforce_eager + Python hooks) and freeze (taps compiled in) modes.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a step's rows leave
the tap buffer once, straight into each request's host destination (engine/capture/transport.py):
nothing is serialized through the engine's RPC, which is what holds the best-known peer to about
a tenth of vLLM's prefill speed on all-layer capture. The runner and worker are ours, named to
vLLM explicitly (engine/vllm/runner.py); every vLLM internal they read is in engine/vllm/compat.py.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from . import compat
from . import compat_check
from .. import platform as plat
from ..capture import stepring
from ..addresses import Address, FreezeSet, parse_addresses, resolve_freeze_points
from ..capture.captured import CapturedRequest
from ..checkpoint import ModelInfo, read_model_info, validate_tokens
from ..protocol import CaptureMode, DestinationProvider, StepStats
from ..parallel import (EngineLost, check_parallel, check_tp_fits, check_tp_points,
                                     remove_dist_files, remove_queue_shm, clear_rpc_dir, own_rpc_dir)
from .remote import RemoteHarvest, RemoteStats, open_rows_path

log = logging.getLogger("harvest.engine")

@dataclass
class _Req:
    index: int
    ids: np.ndarray
    internal: str


class _NoChatWarmupTrace(logging.Filter):
    """vLLM's LLM() renders a chat template to warm up and, with skip_tokenizer_init=True (we feed
    token ids, never text), logs the failure as a 15-line WARNING traceback per engine that reads
    like an error and is not. Only that record is dropped; every other vLLM warning stays."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Chat template warmup failed")


def _quiet_chat_warmup() -> None:
    lg = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _NoChatWarmupTrace) for f in lg.filters):
        lg.addFilter(_NoChatWarmupTrace())


# vLLM's default max_num_seqs when none is given (SchedulerConfig, 0.32.0): sizes the step ring's
# request table; a step with more requests fails loudly (stepring.RingWriter.publish).
DEFAULT_MAX_SEQS = 1024

class VLLMModel:
    """A harvest.engine.protocol.CaptureEngine on vLLM."""

    backend = "vllm"
    accepts_destinations = True

    def __init__(self, name_or_path: str, *, freeze_points="auto", freeze_writes=None,
                 enforce_eager: bool | None = None, dtype: str = "bfloat16",
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                 revision: str | None = None, tensor_parallel_size: int = 1, seed: int = 0,
                 staging: bool | None = None, async_scheduling: bool | None = None,
                 shared_destination_bytes: int | None = None, model_runner: str | None = None,
                 **engine_args):
        self.info: ModelInfo = read_model_info(name_or_path, revision)
        self.name, self.revision = name_or_path, revision
        self.n_layers, self.width = self.info.n_layers, self.info.width
        self.frozen: FreezeSet | None = resolve_freeze_points(
            freeze_points, self.n_layers, self.info.n_streams, freeze_writes, enforce_eager
        ).freeze_set()  # None: hooked mode, which must run eager (hooks never fire compiled)
        self.mode: CaptureMode
        if self.frozen is None:
            self.mode = "hooked"
        elif not self.frozen.reads and not self.frozen.writes:
            self.mode = "plain"
        else:
            self.mode = "freeze"
        self.tp = check_parallel(tensor_parallel_size, engine_args.get("pipeline_parallel_size", 1),
                                 self.mode)
        check_tp_points(self.tp, self.info, self.frozen.reads if self.frozen else ())
        if self.tp > 1:  # before vLLM starts: its refusal comes late and wrapped (parallel.py)
            from transformers import AutoConfig

            check_tp_fits(self.tp, AutoConfig.from_pretrained(name_or_path, revision=revision)
                          .to_dict(), model=name_or_path)
        self.profile = plat.detect()
        eng = plat.engine_defaults(self.profile, {
            **engine_args, "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs, "gpu_memory_utilization": gpu_memory_utilization})
        self.max_num_batched_tokens = eng["max_num_batched_tokens"]
        self.max_model_len = min(max_model_len or self.info.max_position, self.info.max_position)
        # "v1" or "v2" (HARVEST_MODEL_RUNNER, or `model_runner=`): checked against what the
        # workers built once the engine is up
        self.runner = compat.engine_environment(on_cpu=self.profile.name == "cpu", runner=model_runner)
        compat_check.require(self.runner)
        if self.tp > 1:
            # Inside a Ray actor vLLM would pick its Ray executor (ranks as Ray actors, maybe on
            # other nodes: "current platform cpu does not support ray" on the CPU build). The
            # ranks must be processes of this one, on this node: they share the step ring in
            # /dev/shm, and the actor's placement group holds their devices.
            backend = eng.get("distributed_executor_backend") or "mp"
            if backend != "mp":
                raise ValueError(
                    f"distributed_executor_backend={backend!r}: tensor-parallel capture runs its "
                    "ranks with vLLM's multiprocessing executor ('mp'), on the engine's node")
            eng["distributed_executor_backend"] = "mp"
            if self.profile.name == "cpu":
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", compat.cpu_thread_binding(self.tp))
            if self.mode != "plain":
                eng["compilation_config"] = compat.tp_compilation_config(eng.get("compilation_config"))
        from vllm import LLM

        _quiet_chat_warmup()

        extra = dict(eng.pop("additional_config", None) or {})
        extra["harvest"] = {
            "mode": self.mode,
            "reads": [str(a) for a in (self.frozen.reads if self.frozen else ())],
            "writes": [str(a) for a in (self.frozen.writes if self.frozen else ())],
            "staging": self.profile.staging if staging is None else bool(staging),
        }
        if self.mode != "plain":
            log.info("prefix caching is off while capturing: cached tokens skip the forward, "
                     "so their rows would never reach a tap")
        if async_scheduling is not None:
            # Left to vLLM's default otherwise (on for CUDA, off on the CPU build): the row map is
            # read right after each execute_model from the batch of that very step, before the
            # next step's state update, and max_tokens=1 never schedules a decode step (vLLM's
            # async scheduler skips a request whose last step reached max_tokens), so the map
            # holds under async scheduling too; each step's fed positions and token ids are
            # checked against it, and a stray row fails the capture.
            eng["async_scheduling"] = async_scheduling
        ring = self.arena = None
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if self.tp > 1 and self.mode == "freeze" and self.frozen.reads:
            ring, self.arena = open_rows_path(
                len(self.frozen.reads), self.max_num_batched_tokens, self.rows_width(),
                self.dtype,
                eng.get("max_num_seqs") or DEFAULT_MAX_SEQS, shared_destination_bytes)
            # a fixed marker: the spec (per-engine file names) travels in the workers'
            # environment, out of vLLM's compile-cache key (stepring.RING_ENV)
            extra["harvest"]["ring"] = True
            os.environ[stepring.RING_ENV] = json.dumps(ring.spec.as_dict())
        worker = compat.HARVEST_CPU_WORKER if self.profile.name == "cpu" else compat.HARVEST_GPU_WORKER
        try:
            self.llm = LLM(
                model=name_or_path, revision=revision, tokenizer_revision=revision, dtype=dtype,
                enforce_eager=bool(enforce_eager) or self.frozen is None,
                enable_prefix_caching=False, enable_chunked_prefill=True,
                max_model_len=self.max_model_len, skip_tokenizer_init=True,
                tensor_parallel_size=tensor_parallel_size, seed=seed, additional_config=extra,
                worker_cls=worker, **eng)
        finally:
            os.environ.pop(stepring.RING_ENV, None)
            if ring is not None:
                ring.unlink()  # the workers mapped it while loading (or failed): no file left
            if self.arena is not None:
                self.arena.unlink()
        if self.tp > 1:
            self.state = self._remote_state(ring)
            self._dist_ident = _dist_ident(self.llm)
            self._queue_shm = compat.message_queue_shm(self.llm)
        else:
            self.state = compat.worker_call(self.llm, "harvest_state")
        if self.state is None:
            raise RuntimeError(f"vLLM built the engine without the harvest runner ({worker})")
        built = {i.runner for i in compat.worker_calls(self.llm, "harvest_info") if i}
        if built != {self.runner}:
            self.close()
            raise compat.VLLMIncompatible(
                f"the capture engine asked vLLM for Model Runner {self.runner.upper()} but its "
                f"workers built {sorted(built)}: a vLLM setting forced another runner")
        self._next_id = 0
        self._tokenizer = None

    def _remote_state(self, ring):
        """Tensor parallel: the runner state lives in the workers; the capture loop keeps a
        RemoteHarvest fed from the step ring (engine/vllm/remote.py)."""
        infos = compat.worker_calls(self.llm, "harvest_info")
        if any(i is None for i in infos):
            return None
        publishers = sum(i.publishes for i in infos)
        if ring is not None and publishers != 1:
            raise RuntimeError(f"{publishers} tensor-parallel ranks publish rows (expected exactly "
                               "one, the output rank): rows would be lost or doubled")
        if ring is None:  # plain: no taps, nothing to read; steps are counted on the workers
            return RemoteStats(self.llm)
        out = infos[0]
        if self.arena is not None:
            # memory a writer dropped is reused only after every step that was running then
            # has published (shmdest: the fence against a late write by the rank)
            self.arena.published = ring.latest
            self.arena.in_flight = compat.max_concurrent_batches(self.llm) - 1
        return RemoteHarvest(self.llm, ring, self.frozen.reads, self.frozen.writes,
                             self.rows_width(), self.dtype, self.max_num_batched_tokens, out, self.arena)

    @property
    def lost(self) -> bool:
        """True once vLLM's executor failed (a worker process died): the engine is unusable."""
        llm = getattr(self, "llm", None)
        return llm is not None and compat.executor_failed(llm)

    # -- metadata ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.name, revision=self.revision)
        return self._tokenizer

    def describe(self) -> dict:
        import vllm

        return {
            "model": self.name, "revision": self.revision, "backend": "vllm", "mode": self.mode,
            "dtype": str(self.dtype).replace("torch.", ""), "n_layers": self.n_layers,
            "width": self.width, "max_num_batched_tokens": self.max_num_batched_tokens,
            "frozen_reads": [str(a) for a in self.frozen.reads] if self.frozen else None,
            "platform": self.profile.name, "tensor_parallel_size": self.tp,
            "model_runner": self.runner,
            "rows_path": ("in process" if self.tp == 1 else "shared destinations (one host copy)"
                          if self.arena is not None else "step ring (one extra host copy)"),
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        }

    def shared_allocator(self):
        """Tensor parallel: `allocate(shape, dtype) -> np.ndarray` from the shared destination
        arena, for the buffers rows go to (the writer's block buffers: store.writeblocks.
        use_allocator), so the publishing rank writes rows straight into them (engine/capture/shmdest.py).
        None when rows never leave another process (TP=1) or the arena is off."""
        return self.arena.allocate if getattr(self, "arena", None) is not None else None

    def engine_settings(self) -> dict:
        """vLLM's resolved compile / CUDA-graph / async-scheduling settings (gpu_check prints)."""
        return compat.engine_settings(self.llm)

    def step_stats(self) -> StepStats:
        """Cumulative {"steps", "scheduled_tokens", "max_num_batched_tokens"} (step fill)."""
        return self.state.step_stats()

    # -- capture ----------------------------------------------------------------------------
    def next_request_id(self, prefix: str) -> str:
        """A request id unique within this engine (capture and generate share the counter)."""
        rid = f"{prefix}{self._next_id}"
        self._next_id += 1
        return rid

    def resolve_points(self, points) -> tuple[Address, ...]:
        """The addresses a capture call reads: `points` checked against the mode, or the
        mode's default (freeze: every frozen read)."""
        if points is None:
            if self.mode == "freeze":
                return self.frozen.reads
            if self.mode == "plain":
                return ()
            raise ValueError("hooked mode needs explicit points, e.g. ['resid_post.0']")
        pts = parse_addresses([points] if isinstance(points, (str, Address)) else points,
                              self.n_layers)
        if self.mode == "freeze":
            self.frozen.check_read(pts)
        elif self.mode == "plain" and pts:
            raise ValueError("this engine was loaded with freeze_points=[] (plain, no taps); "
                             "load it with freeze_points='auto' or a list to capture")
        return pts

    def set_steering(self, addr, vec) -> None:
        """Additive steering at a frozen write site; zeros turn it off."""
        a = Address.parse(addr)
        if not self.frozen or a not in self.frozen.writes:
            writes = ", ".join(map(str, self.frozen.writes)) if self.frozen else "none"
            raise ValueError(f"{a} has no write buffer (frozen writes: {writes})")
        if self.tp > 1:
            self.state.set_steer(a, torch.as_tensor(vec, dtype=self.dtype))
        else:
            self.state.taps.steer[a].copy_(torch.as_tensor(vec, dtype=self.dtype))

    def set_poison(self, on: bool) -> None:
        """Fill the tap buffer with NaN before every forward: a delivered row no tap wrote in
        that very step is then NaN (the check that taps run on the compiled path and in CUDA
        graph replays, where no Python runs)."""
        self.state.poison = bool(on)

    @property
    def quantizes(self) -> bool:
        """Whether `capture(quantize=...)` is served: in-process taps (not tensor parallel,
        whose rows cross the step ring unquantised)."""
        return self.tp == 1

    def capture(self, batches: Iterable[Sequence[Sequence[int]]], points=None,
                max_in_flight_tokens: int | None = None,
                destinations: DestinationProvider | None = None,
                quantize: str | None = None) -> Iterator[CapturedRequest]:
        """Stream requests' rows as each request's rows become final, with bounded memory.

        `batches` is consumed lazily; at most `max_in_flight_tokens` prompt tokens (default four
        engine steps' worth) are submitted and not yet handed over, so host memory for rows is
        bounded by (max_in_flight_tokens + longest request) x points x width x itemsize, whatever
        the length of the input (plus n x 12 bytes of fed ids/positions per step in flight).

        `destinations(index, n)` may return where request `index`'s rows go: a host tensor
        [len(points), n, width] in the engine dtype whose per-point rows are contiguous (a slice
        [:, a:a+n] of a [points, rows, width] buffer is), pinned on CUDA; None means a fresh
        tensor. Ownership:
        - from the call until the request is yielded, the engine owns that memory: copies into
          it are in flight (asynchronous on CUDA); the caller must not read, write or reuse it;
        - when the request is yielded its rows are final: every position was covered by a
          completed copy of rows the runner computed from exactly the request's tokens at
          exactly those positions, and the engine never writes there again;
        - if the capture ends early (the consumer closes the generator, or any error), the
          remaining requests are aborted in vLLM and every copy in flight is waited for before
          the generator returns or raises; the memory is the caller's again, its contents
          undefined (partial rows): discard it (e.g. abort the region's writer).

        `quantize="float8_e4m3fn"`: rows are quantised on the device before they leave it
        (engine/capture/quantize.py: e4m3fn bytes and a float32 scale per row), so each request's rows
        are uint8 `[points, n, width + 4]` (destinations too). The engine's other checks (the
        model check) capture unquantised rows.
        """
        from vllm import SamplingParams

        pts = self.resolve_points(points)
        st = self.state
        capturing = bool(pts)
        if capturing:
            st.begin_capture(pts, quantize)
        budget = max_in_flight_tokens or 4 * self.max_num_batched_tokens
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        engine = self.llm.llm_engine
        source = (t for batch in batches for t in batch)
        reqs: dict[str, _Req] = {}  # external id -> request not yet handed over
        finished: deque[str] = deque()  # vLLM finished them; rows may still be in flight
        base = self._next_id  # indices restart at 0 for every capture call
        in_flight, exhausted = 0, False
        try:
            while True:
                while not exhausted and in_flight < budget:
                    toks = next(source, None)
                    if toks is None:
                        exhausted = True
                        break
                    ids = validate_tokens(toks, self.max_model_len - 1, self.info.vocab_size)
                    rid = f"h{self._next_id}"
                    index = self._next_id - base
                    self._next_id += 1
                    acts = None
                    if capturing:
                        acts = st.destination(destinations(index, len(ids)) if destinations else None,
                                              len(ids))
                    internal = compat.add_request(engine, rid, ids.tolist(), params)
                    if capturing:
                        st.register(internal, acts, ids)
                    reqs[rid] = _Req(index, ids, internal)
                    in_flight += len(ids)
                if not reqs:
                    break
                stepped = engine.has_unfinished_requests()
                try:
                    outputs = engine.step() if stepped else []
                except Exception as e:
                    if self.lost:
                        raise EngineLost(
                            f"a tensor-parallel worker process of this engine died mid-step "
                            f"(vLLM shut its executor down; it answered: {e!r}); the engine "
                            "cannot run again: load a new one") from e
                    raise
                for out in outputs:
                    if out.finished:
                        finished.append(out.request_id)
                        if capturing:
                            st.mark_finished(reqs[out.request_id].internal)
                if capturing:
                    st.raise_if_failed()
                    st.poll(block=not stepped)  # block only when no step is left to run
                handed = 0
                for _ in range(len(finished)):
                    rid = finished.popleft()
                    r = reqs[rid]
                    if capturing and not st.is_final(r.internal):
                        finished.append(rid)
                        continue
                    del reqs[rid]
                    in_flight -= len(r.ids)
                    handed += 1
                    yield self._handover(r, pts)
                if not stepped and not handed and not outputs:
                    raise RuntimeError(
                        f"capture stalled: vLLM has no unfinished requests but {len(reqs)} were "
                        "never reported finished")
        finally:
            if reqs:
                self._abort(engine, reqs, capturing)

    def generate(self, batches, points=None, sampling=None, max_in_flight_tokens: int | None = None,
                 destinations: DestinationProvider | None = None, seeds=None):
        """Complete prompts and stream each sample's prompt + generated rows (engine/vllm/generate.py)."""
        from .generate import generate

        return generate(self, batches, points, sampling, max_in_flight_tokens, destinations, seeds)

    def generate_with_cache(self, prompts, points=None, sampling=None):
        """out[i][s]: sample s of prompt i, a GeneratedRequest (rows of every fed token)."""
        from .generate import generate_with_cache

        return generate_with_cache(self, prompts, points, sampling)

    def _handover(self, r: _Req, pts) -> CapturedRequest:
        n = len(r.ids)
        if pts:
            acts = self.state.take(r.internal, f"request {r.index}")
        else:
            acts = torch.empty(0, n, self.width, dtype=self.dtype)
        widths = self.point_widths(pts)
        return CapturedRequest(r.index, r.ids, np.arange(n, dtype=np.int32), tuple(pts), acts,
                               None if all(w == acts.shape[-1] for w in widths) else widths)

    def rows_width(self) -> int:
        """The width of a frozen capture's rows: the widest frozen read's full width (the tap
        buffer's, engine/capture/taps.buffer_width), never less than the stream's."""
        reads = self.frozen.reads if self.frozen else ()
        return max([self.width, *self.point_widths(reads)])

    def point_widths(self, pts) -> tuple[int, ...]:
        """Each point's own width (engine/points.py): rows of `acts` are cut to it; points of
        32-bit values (logprob, entropy, expert routing) occupy that many values' worth of the
        engine dtype (engine/capture/packed.py)."""
        return tuple(self.info.row_width(Address.parse(a).name, self.dtype) for a in pts)

    def _abort(self, engine, reqs: dict[str, _Req], capturing: bool) -> None:
        try:
            engine.abort_request(list(reqs))
        finally:
            if capturing:
                self.state.wait_all_and_drop([r.internal for r in reqs.values()])

    def close(self) -> None:
        self.state = None
        arena, self.arena = getattr(self, "arena", None), None
        llm, self.llm = getattr(self, "llm", None), None
        queues = getattr(self, "_queue_shm", [])
        if llm is not None:
            if queues and compat.executor_failed(llm):
                # a rank died: its queue's segment is left, and this close may not finish
                # before the actor's process ends
                remove_queue_shm(queues)
            try:
                compat.shutdown(llm)
            except Exception:
                pass
            del llm
        gc.collect()
        if arena is not None:
            arena.close()
        remove_dist_files(getattr(self, "_dist_ident", None))
        remove_queue_shm(queues)
        base = os.environ.get("VLLM_RPC_BASE_PATH", "")
        if own_rpc_dir(base):   # ours, not an operator's
            clear_rpc_dir(base)


def _dist_ident(llm) -> "str | None":
    """The rank group's file name prefix (parallel.remove_dist_files), asked of the ranks."""
    try:
        return next((i for i in compat.worker_calls(llm, "harvest_dist_ident") if i), None)
    except Exception:  # noqa: BLE001 -- only used to clean up at close
        return None
