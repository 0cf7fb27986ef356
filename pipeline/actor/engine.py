"""A capture actor's engine: its threads and cores on this host, the engine built on them, and
the checks it passes before the actor takes a unit (capture.py hosts it).

Kept apart from the actor's unit handling: what is decided here (OpenMP threads, core binding,
the compression pool's size, which factory builds the engine) happens once, before the engine
loads, and must be in place before torch and vLLM read it from the environment.
"""

from __future__ import annotations

import os

from ..messages import ActorSpec


def cpu_slice(index: int, threads: int) -> list[int]:
    """Actor `index`'s own `threads` cores of this node (wrapping round), so two CPU engines
    never pin their OpenMP threads to the same cores."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return []
    start = (index * threads) % len(cpus)
    return [cpus[(start + k) % len(cpus)] for k in range(min(threads, len(cpus)))]


def gpu_ids() -> list:
    """The GPUs Ray gave this actor ([] outside a Ray worker)."""
    try:
        import ray

        # outside a Ray worker (tests, benchmarks) get_gpu_ids() would start a cluster
        return list(ray.get_gpu_ids()) if ray.is_initialized() else []
    except Exception:
        return []


def load_engine(spec: ActorSpec):
    """Build the engine `spec` names and check it against the engine contract. Returns
    (engine, platform profile name)."""
    engine, profile = _build_engine(spec)
    from ...engine.protocol import problems

    wrong = problems(engine)
    if wrong:  # before any unit: a stub or new backend that lacks a member fails here, named
        raise TypeError(f"{type(engine).__qualname__} is not a harvest.engine.protocol."
                        f"CaptureEngine: {'; '.join(wrong)}")
    return engine, profile


def _build_engine(spec: ActorSpec):
    from ...engine import platform

    profile = platform.detect()
    share = platform.cpu_share()
    if profile.name == "cpu":
        # the forward runs on these threads: the driver's default splits this node's cores
        # over its actors (Ray's fractional CPU share of a CPU actor says nothing about them)
        threads = spec.threads
    else:
        # a GPU actor's host threads come from its own CPU share, never the driver's cores
        threads = platform.engine_threads(profile, spec.threads_requested, share)
    # the writer's compression pool (pipeline.store stays free of engine imports: it reads
    # the size from the environment, set here before the first encode)
    os.environ.setdefault("HARVEST_CODEC_THREADS", str(platform.codec_threads(profile, share)))
    # Ray sets OMP_NUM_THREADS=1 for fractional-CPU actors; OpenMP reads it when torch loads.
    # PASSIVE: OpenMP threads that spin at barriers take the cores the writer's compression
    # threads and Ray's own threads need; measured in a Ray actor on 2 shared cores, tiny
    # llama: 9.6k tok/s spinning vs 40.5k passive (eager), 12.4k vs 33-53k (vLLM freeze).
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(threads)
    if spec.engine_factory:  # benchmarks: a stub engine measures the bookkeeping alone
        import importlib

        mod, _, name = spec.engine_factory.partition(":")
        return getattr(importlib.import_module(mod), name)(spec), profile.name
    if spec.engine_kwargs.get("backend") == "vllm" and not gpu_ids():
        # Two CPU engines that both bind "auto" would pin their OpenMP threads to the same
        # cores; give each actor its own slice unless the operator chose a binding.
        # A tensor-parallel engine's ranks each need cores of their own: the slice is split
        # into one group per rank ("0|1"), at least one core each.
        tp = int(spec.engine_kwargs.get("tensor_parallel_size") or 1)
        cores = cpu_slice(spec.index, max(threads, tp))
        if cores and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            if tp > 1:
                from ...engine.vllm.compat import cpu_thread_binding

                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp, cores=cores)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    from ...engine import load_model

    return load_model(spec.model_path, **spec.engine_kwargs), profile.name


def check_engine(engine) -> dict:
    """harvest.engine.check_loaded on the actor's engine: its rows against an HF fp32 reference."""
    from ...engine import check_loaded

    try:
        return check_loaded(engine)
    except Exception as e:  # noqa: BLE001 -- reported to the driver, which stops the run
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def close_engine(engine, thread, timeout: float, index: int) -> None:
    """Close an actor's engine (vLLM's executor and ranks, the arena, ring and rank-group files
    in /dev/shm) on its engine `thread` (None: the caller is that thread), waiting at most
    `timeout` seconds; best effort, at the end of the actor's process."""
    import logging
    import threading

    try:
        if thread is None:
            t = threading.Thread(target=engine.close, daemon=True)
            t.start()
            t.join(timeout)
        else:
            thread.submit(engine.close).result(timeout)
    except Exception as e:  # noqa: BLE001
        logging.getLogger("harvest.actor").warning("actor %d: closing the engine: %s: %s", index,
                                                   type(e).__name__, e)
