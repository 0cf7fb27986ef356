"""Ray lifecycle for a run: connect or start, the capture actors' specs and start-up, errors.

The capture actors ask for fractional CPUs on CPU-only clusters (two whole-CPU actors starve
every other task on 2 cores) and one GPU each on GPU clusters.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from typing import Any

from .config import HarvestConfig
from .errors import HarvestError
from .messages import ActorSpec

log = logging.getLogger("harvest.pipeline")

FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "HARVEST_CACHE",
                 "HF_HOME", "HF_HUB_OFFLINE", "HARVEST_LOG_DIR", "VLLM_CACHE_ROOT",
                 "TORCHINDUCTOR_CACHE_DIR")
# Threads a capture actor runs method calls on: units in flight plus info/ping/figures calls.
ACTOR_CONCURRENCY = 64


def forwarded_env() -> dict:
    return {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}


def ensure_ray(cfg: HarvestConfig) -> bool:
    """Connect to the cluster Ray gives us, or start a local one. True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    from .logs import quiet

    # quiet runs (logs.quiet_run): worker output stays in the run's log folder, not on the console
    kw: dict[str, Any] = {"log_to_driver": not quiet()}
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        kw["address"] = address
    elif cfg.ray.local_num_cpus:
        kw["num_cpus"] = cfg.ray.local_num_cpus
    ray.init(**kw)
    return True


def actor_spec(cfg: HarvestConfig, prep, index: int,
               engine_factory: str | None = None) -> ActorSpec:
    threads = cfg.ray.threads_per_actor or max(1, multiprocessing.cpu_count() // cfg.ray.num_actors)
    return ActorSpec(
        index=index,
        model_path=prep.model_path,
        engine_kwargs=cfg.model.engine_kwargs(prep.points),
        engine_factory=engine_factory,
        points=tuple(prep.points),
        context_size=cfg.packing.context_size,
        store_url=cfg.store.resolved_url,
        storage_options=cfg.store.fs_options(),
        threads=threads,  # the CPU build's default: this node's cores over its actors
        threads_requested=cfg.ray.threads_per_actor,  # GPU actors size from their own share
        check_model=index == 0 and cfg.capture.check_model and cfg.model.backend == "vllm",
        env=forwarded_env(),
    )


def start_actors(cfg: HarvestConfig, prep, engine_factory: str | None = None) -> list:
    import ray

    from .actor import HarvestActor

    Remote = ray.remote(HarvestActor)
    cpus, gpus = cfg.ray.actor_resources(ray.cluster_resources())
    if gpus and cfg.model.tensor_parallel_size > gpus:
        gpus = float(cfg.model.tensor_parallel_size)
    log.info("starting %d actors with %s CPU and %s GPU each", cfg.ray.num_actors, cpus, gpus)
    opts = dict(num_cpus=cpus, num_gpus=gpus, max_restarts=cfg.ray.max_restarts,
                max_task_retries=cfg.ray.max_task_retries, max_concurrency=ACTOR_CONCURRENCY)
    return [Remote.options(**opts).remote(actor_spec(cfg, prep, i, engine_factory))
            for i in range(cfg.ray.num_actors)]


def root_cause(exc: BaseException) -> str:
    """The actor-side error text without Ray's wrapping traceback."""
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def collect_infos(refs: list, cfg: HarvestConfig, prep) -> list[dict]:
    """The actors' info() results, checked against the model the driver prepared for."""
    import ray

    infos = []
    for i, r in enumerate(refs):
        try:
            infos.append(ray.get(r))
        except Exception as e:
            raise HarvestError(
                f"actor {i} could not load the engine for model.path={cfg.model.path!r}: "
                f"{root_cause(e)}"
            ) from None
    for inf in infos:
        if inf["width"] != prep.width or inf["n_layers"] != prep.n_layers:
            raise HarvestError(
                f"actor {inf['index']} loaded a model of width {inf['width']} x {inf['n_layers']} "
                f"layers, the config of {cfg.model.path} says {prep.width} x {prep.n_layers}")
    return infos


def kill_all(handles: list) -> None:
    import ray

    for a in handles:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001
            pass


def waiting_line(pending: int, total: int, t0: float) -> str:
    import ray

    return (f"waiting for {pending} of {total} actors to start ({time.time() - t0:.0f} s; the "
            f"cluster has {({k: v for k, v in ray.cluster_resources().items() if k in ('CPU', 'GPU')})})")
