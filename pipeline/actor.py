"""The Ray actor: one engine and the store region writers of the units it is given.

Activations never travel through Ray's object store (hundreds of KB per token would make it the
bottleneck): the actor reads its unit's token ids from the store, captures them, writes the
region itself and returns a small manifest. A unit is done only when its region is committed, so
a retry after a crash (Ray's `max_task_retries`) rewrites the same shards and the create-once commit
marker makes the second commit harmless: at-least-once execution, exactly-once result.

The actor is threaded (`max_concurrency` = units in flight): the engine runs one unit at a time
on its own thread, while the previous unit's last shards upload and commit on Ray's thread, so
the engine is not idle during uploads.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

log = logging.getLogger("harvest.actor")


def _cpu_slice(index: int, threads: int) -> list[int]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return []
    start = (index * threads) % len(cpus)
    return [cpus[(start + k) % len(cpus)] for k in range(min(threads, len(cpus)))]


class HarvestActor:
    """Hosts one engine. Created by the driver with `ray.remote(HarvestActor).options(...)`."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.index = int(spec["index"])
        for k, v in (spec.get("env") or {}).items():
            os.environ[k] = v
        # Every engine call runs on this one thread. Ray runs a threaded actor's methods on pool
        # threads, and vLLM CPU's attention checks that the OpenMP thread count of the thread that
        # built its metadata is the one that runs it ("thread_num == thread_num (2 vs. 1)").
        # Named at the OS level before the engine loads, so its OpenMP team (spawned from this
        # thread) carries the name too: per-thread CPU in /proc then splits engine from writer.
        from pipeline.store.shardio import name_native_thread

        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="harvest-engine",
                                                 initializer=name_native_thread)
        t0 = time.perf_counter()
        self.engine = self._engine_thread.submit(self._load_engine, spec).result()
        self.load_seconds = time.perf_counter() - t0
        self.points = list(spec["points"])
        self.context_size = int(spec["context_size"])
        self.batch_contexts = int(spec.get("batch_contexts") or 32)
        self._store = None
        self._store_lock = threading.Lock()
        self.started = time.time()
        self.units_done = 0
        self.tokens_done = 0
        self.busy_seconds = 0.0
        self._metrics = _metrics()

    def _load_engine(self, spec: dict):
        threads = int(spec.get("threads") or 1)
        # Ray sets OMP_NUM_THREADS=1 for fractional-CPU actors; OpenMP reads it when torch loads.
        # PASSIVE: OpenMP threads that spin at barriers take the cores the writer's compression
        # threads and Ray's own threads need; measured in a Ray actor on 2 shared cores, tiny
        # llama: 9.6k tok/s spinning vs 40.5k passive (eager), 12.4k vs 33-53k (vLLM freeze).
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import torch

        torch.set_num_threads(threads)
        gpus = self._gpu_ids()
        if spec["engine_kwargs"].get("backend") == "vllm" and not gpus:
            # Two CPU engines that both bind "auto" would pin their OpenMP threads to the same
            # cores; give each actor its own slice unless the operator chose a binding.
            cores = _cpu_slice(self.index, threads)
            if cores and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        from engine import load_model

        return load_model(spec["model_path"], **spec["engine_kwargs"])

    # -- introspection ----------------------------------------------------------------------
    @staticmethod
    def _gpu_ids() -> list:
        try:
            import ray

            # outside a Ray worker (tests, benchmarks) get_gpu_ids() would start a cluster
            return list(ray.get_gpu_ids()) if ray.is_initialized() else []
        except Exception:
            return []

    def info(self) -> dict:
        e = self.engine
        return {
            "index": self.index,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "gpus": self._gpu_ids(),
            "n_layers": int(e.n_layers),
            "width": int(e.width),
            "max_model_len": int(e.max_model_len),
            "dtype": str(e.dtype).replace("torch.", ""),
            "describe": e.describe(),
            "load_seconds": round(self.load_seconds, 3),
            "threads": int(self.spec.get("threads") or 1),
        }

    def ping(self) -> int:
        return os.getpid()

    # -- work -------------------------------------------------------------------------------
    def _open_store(self):
        with self._store_lock:
            if self._store is None:
                from pipeline.store import open_store

                self._store = open_store(
                    self.spec["store_url"], storage_options=self.spec.get("storage_options")
                )
                if not self._store.location.is_local:
                    # uploads run on fsspec's event-loop thread: below the engine, like the
                    # writer's own threads (see shardio.lower_priority)
                    from fsspec.asyn import get_loop

                    from pipeline.store.shardio import lower_priority

                    get_loop().call_soon_threadsafe(lower_priority)
            return self._store

    def open_store(self) -> int:
        """Open the store and its arrays before the first unit, so unit timings are steady state."""
        store = self._open_store()
        for p in store.points:
            store.array(p)
        store.read_row_meta(0, min(store.n_rows, self.context_size))
        return os.getpid()

    def run_unit(self, unit: dict, attempt: int = 1) -> dict:
        unit_id, rs, re_ = int(unit["unit_id"]), int(unit["row_start"]), int(unit["row_end"])
        base = {"unit_id": unit_id, "row_start": rs, "row_end": re_, "actor": self.index,
                "pid": os.getpid(), "attempt": attempt}
        store = self._open_store()
        if store.is_committed(unit_id):
            return {**base, "status": "already_committed", "tokens": 0, "seconds": 0.0}
        C = self.context_size
        t0 = time.perf_counter()
        token_id, _doc, _pos = store.read_row_meta(rs, re_)
        contexts = np.asarray(token_id, dtype=np.int32).reshape(-1, C)
        lists = contexts.tolist()
        batches = [lists[i : i + self.batch_contexts] for i in range(0, len(lists), self.batch_contexts)]
        writer = store.region_writer(unit_id, rs, re_)
        try:
            seen, capture_seconds = self._engine_thread.submit(
                self._capture_into, writer, batches, contexts, unit_id, rs).result()
            if seen != len(lists):
                raise RuntimeError(f"unit {unit_id}: engine returned {seen} of {len(lists)} contexts")
            # the commit (last uploads + marker) runs here, while the engine thread is already
            # free for the next unit in flight
            manifest = writer.commit(extra={"actor": self.index, "pid": os.getpid(),
                                            "attempt": attempt, "host": socket.gethostname()})
        except BaseException as e:
            try:
                writer.abort()
            except Exception:
                pass
            if _is_conflict(e) and store.is_committed(unit_id):
                # another attempt of this unit committed first: its rows are the same rows
                return {**base, "status": "already_committed", "tokens": 0, "seconds": 0.0}
            raise
        seconds = time.perf_counter() - t0
        n = re_ - rs
        self.units_done += 1
        self.tokens_done += n
        self.busy_seconds += seconds
        if self._metrics:
            try:
                self._metrics[0].inc(n, tags={"actor": str(self.index)})
                self._metrics[1].observe(seconds, tags={"actor": str(self.index)})
            except Exception:
                pass
        return {**base, "status": "committed", "tokens": n, "seconds": round(seconds, 4),
                "capture_seconds": round(capture_seconds, 4),
                "manifest": _small(manifest)}

    def _capture_into(self, writer, batches, contexts, unit_id: int, rs: int) -> tuple[int, float]:
        C = self.context_size
        t0 = time.perf_counter()
        seen = 0
        for req in self.engine.capture(batches, self.points):
            i = int(req.index)
            if not np.array_equal(np.asarray(req.token_ids), contexts[i]):
                raise RuntimeError(
                    f"unit {unit_id}: engine returned request {i} with other tokens than "
                    "submitted; refusing to write rows that do not match their metadata"
                )
            writer.write(rs + i * C, req.acts)
            seen += 1
        return seen, time.perf_counter() - t0

    def stats(self) -> dict:
        return {"index": self.index, "pid": os.getpid(), "units": self.units_done,
                "tokens": self.tokens_done, "busy_seconds": round(self.busy_seconds, 3)}

    def close(self) -> None:
        try:
            self._engine_thread.submit(self.engine.close).result()
        except Exception:
            pass


def _is_conflict(e: BaseException) -> bool:
    try:
        from pipeline.store.errors import RegionConflict

        return isinstance(e, RegionConflict)
    except Exception:
        return False


def _small(manifest: Any) -> Any:
    """Keep the manifest returned through Ray small: drop bulky per-point stats arrays."""
    if not isinstance(manifest, dict):
        return None
    out = {}
    for k, v in manifest.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
    return out


def _metrics():
    """Ray dashboard metrics (tokens captured, seconds per unit); absent outside a Ray worker."""
    try:
        from ray.util.metrics import Counter, Histogram

        return (
            Counter("harvest_tokens_captured", "tokens captured and committed", tag_keys=("actor",)),
            Histogram("harvest_unit_seconds", "seconds per committed unit",
                      boundaries=[0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300], tag_keys=("actor",)),
        )
    except Exception:
        return None
