"""Ray lifecycle for a run: connect or start, the capture actors' specs and start-up, errors.

The capture actors ask for fractional CPUs on CPU-only clusters (two whole-CPU actors starve
every other task on 2 cores) and one GPU each on GPU clusters.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any

from . import exits
from ..actor import generation
from ..actor.capture import HarvestActor
from ..config.run import HarvestConfig
from ..config.sections import ModelConfig, RayConfig
from ..errors import HarvestError
from ..logs import quiet
from ..messages import ActorInfo, ActorSpec, StreamSpec

log = logging.getLogger("harvest.pipeline")

FORWARDED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "HARVEST_CACHE",
                 "HF_HOME", "HF_HUB_OFFLINE", "HARVEST_LOG_DIR", "VLLM_CACHE_ROOT",
                 "TORCHINDUCTOR_CACHE_DIR", "HARVEST_MODEL_RUNNER", "HARVEST_TRITON_INTERPRET", "TRITON_INTERPRET")
# Threads a capture actor runs method calls on: units in flight plus info/ping/figures calls.
ACTOR_CONCURRENCY = 64


def forwarded_env() -> dict:
    return {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}


def ensure_ray(ray_cfg: RayConfig) -> bool:
    """Connect to the cluster Ray gives us, or start a local one. True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    # quiet runs (logs.quiet_run): worker output stays in the run's log folder, not on the console
    kw: dict[str, Any] = {"log_to_driver": not quiet()}
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, **kw)
        finally:
            exits.install()  # ray.init replaced the SIGTERM handler with its own
        return True
    if ray_cfg.local_num_cpus:
        kw["num_cpus"] = ray_cfg.local_num_cpus
    exits.init_local_ray(kw)
    return True


def actor_spec(cfg: HarvestConfig, prep, index: int, engine_factory: str | None = None,
               stream: "StreamSpec | None" = None, writes_store: bool = True) -> ActorSpec:
    """Actor `index`'s part of the run: the one place the config is cut into what a capture
    actor reads (its engine from `model`, its points and generation from `capture`, where it
    writes from `store`, its threads from `ray`); the actor never sees the config itself.
    A streamed run adds its `stream` section (pipeline/stream/hooks.py); without a tee
    (`writes_store` False) the actor gets no store."""
    threads = cfg.ray.threads_per_actor or max(1, multiprocessing.cpu_count() // cfg.ray.num_actors)
    return ActorSpec(
        index=index,
        model_path=prep.model_path,
        engine_kwargs=cfg.model.engine_kwargs(list(prep.addresses or prep.points)),
        engine_factory=engine_factory,
        points=tuple(prep.addresses or prep.points),   # parsed once (prepare.resolve_points)
        context_size=cfg.packing.context_size,
        store_url=cfg.store.resolved_url if writes_store else None,
        storage_options=cfg.store.fs_options(),
        threads=threads,  # the CPU build's default: this node's cores over its actors
        threads_requested=cfg.ray.threads_per_actor,  # GPU actors size from their own share
        check_model=index == 0 and cfg.capture.check_model and cfg.model.backend == "vllm",
        env=forwarded_env(),
        generate=generation.actor_section(cfg.capture.generate, cfg.data.format == "chat",
                                          prep.model_path),
        stream=stream,
    )


def start_actors(ray_cfg: RayConfig, tp: int, specs: list[ActorSpec], local: bool = False) -> list:
    """The capture actors (not yet ready), one per spec (actor_spec); `tp`: the engine's
    model.tensor_parallel_size. `local`: the cluster is one this driver started."""
    import ray

    Remote = ray.remote(HarvestActor)
    request = actor_request(ray_cfg, tp)
    cpus, gpus = request["CPU"], request["GPU"]
    if local and not fitting_nodes(request):
        # a local cluster never grows: waiting out ray.start_timeout_s would change nothing
        raise HarvestError(start_report(ray_cfg, [], request, None))
    log.info("starting %d actors with %s CPU and %s GPU each%s", len(specs), cpus, gpus,
             f", each a tensor-parallel group of {tp} ranks on one node" if tp > 1 else "")
    opts = dict(num_cpus=cpus, num_gpus=gpus, max_restarts=ray_cfg.max_restarts,
                max_task_retries=ray_cfg.max_task_retries, max_concurrency=ACTOR_CONCURRENCY)
    actors = Actors()
    for spec in specs:
        placement = group_placement(tp, request)
        if placement:
            actors.groups.append(placement["scheduling_strategy"].placement_group)
        actors.append(Remote.options(**opts, **placement).remote(spec))
    return actors


class Actors(list):
    """The run's actor handles, and the placement groups reserved for them (tensor parallel).

    The groups are removed with the actors (`kill_all`): a group outlives its actor otherwise, and
    on a cluster shared by several runs (a driver that connects with ray.address, or a test
    session's cluster) each finished run's groups kept their CPUs and GPUs reserved, so a later
    run's actors waited for resources nobody used (two TP runs' groups held 1 of a 2-CPU
    cluster's CPUs and the next two-actor run never placed its second actor)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.groups: list = []


def group_placement(tp: int, request: dict) -> dict:
    """Tensor parallel: the actor's TP devices reserved together on one node, as one placement
    group (one bundle, STRICT_PACK) the actor is scheduled into. vLLM's multiprocessing executor
    starts its rank processes inside the actor, on the actor's node, with the devices Ray gave
    the actor (CUDA_VISIBLE_DEVICES), so the actor must hold all of them; the group makes that
    reservation explicit and atomic (no actor holding half its GPUs while another waits for the
    rest), and a restarted actor (ray.max_restarts) comes back into the same reservation. The
    group is removed with the actors at the end of the run (kill_all). TP=1 actors keep plain resource requests."""
    if tp <= 1:
        return {}
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {k: float(v) for k, v in request.items() if v}
    pg = placement_group([bundle], strategy="STRICT_PACK")  # unnamed: runs may share a namespace
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)}


def actor_request(ray_cfg: RayConfig, tp: int) -> dict:
    """The resources one capture actor asks Ray for (`tp`: model.tensor_parallel_size)."""
    import ray

    cpus, gpus = ray_cfg.actor_resources(ray.cluster_resources())
    if gpus and tp > gpus:
        gpus = float(tp)
    return {"CPU": float(cpus), "GPU": float(gpus)}


def _nodes() -> list[dict]:
    import ray

    return [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]


def fitting_nodes(request: dict) -> list[dict]:
    """The live nodes whose total resources could hold one actor."""
    return [n for n in _nodes() if all(n.get(k, 0.0) >= v for k, v in request.items() if v)]


def _placed(actors: list) -> int:
    """Actors Ray has given a worker process (pid known): the others wait for resources."""
    from ray._private import state  # the GCS's actor table: works without the dashboard

    n = 0
    for a in actors:
        try:
            n += bool((state.actors(actor_id=a._actor_id.hex()) or {}).get("Pid"))
        except Exception:  # noqa: BLE001 -- a report, best effort
            pass
    return n


def _never_placed(actor) -> bool:
    """The actor still waits for resources and never had a process (no pid, no restart): it has
    no engine to close. False when the GCS's actor table cannot be read."""
    from ray._private import state

    try:
        row = state.actors(actor_id=actor._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 -- unknown: close it as any other
        return False
    return (row.get("State") in ("DEPENDENCIES_UNREADY", "PENDING_CREATION")
            and not row.get("Pid") and not row.get("NumRestarts"))


def _res(d: dict) -> str:
    return ", ".join(f"{k} {d.get(k, 0.0):g}" for k in ("CPU", "GPU"))


def start_report(ray_cfg: RayConfig, actors: list, request: dict, waited: "float | None") -> str:
    """Why the actors are not all up, in one paragraph: what was asked, what the cluster has,
    how many were placed, and the fix. `waited` None: refused before starting (never fits)."""
    import ray

    n = ray_cfg.num_actors
    asked = "{" + ", ".join(f"{k}: {v:g}" for k, v in request.items() if v) + "}"
    nodes = _nodes()
    head = (f"{n} actors x {asked} asked; the cluster has {_res(ray.cluster_resources())} "
            f"({_res(ray.available_resources())} free) on {len(nodes)} node(s)")
    fix = ("ask for fewer actors (ray.num_actors), less per actor (ray.num_cpus_per_actor, "
           "ray.num_gpus_per_actor) or add nodes")
    if not fitting_nodes(request):
        biggest = max(nodes, key=lambda r: (r.get("GPU", 0.0), r.get("CPU", 0.0)), default={})
        return (f"no node of the cluster can hold one capture actor: {head}, the largest node "
                f"has {_res(biggest)}. Nothing was written; {fix}")
    placed = _placed(actors)
    if placed < len(actors):
        return (f"the capture actors were not all placed within ray.start_timeout_s="
                f"{ray_cfg.start_timeout_s:g} s: {head}: {placed} placed, "
                f"{len(actors) - placed} waiting for resources. Nothing was written; {fix}")
    return (f"the capture actors' engines did not all load within ray.start_timeout_s="
            f"{ray_cfg.start_timeout_s:g} s ({waited:.0f} s waited; all {len(actors)} were "
            f"placed: {head}). Nothing was written; see the actors' logs, or raise "
            "ray.start_timeout_s (a cold compile of a large model takes minutes)")


def root_cause(exc: BaseException) -> str:
    """The actor-side error text without Ray's wrapping traceback."""
    cause = getattr(exc, "cause", None)
    if cause is not None and cause is not exc:
        return f"{type(cause).__name__}: {cause}"
    # the last line that says something: pydantic (vLLM's config errors) ends its message with
    # a "For further information visit <url>" footer, which alone told an operator nothing
    text = [ln.strip() for ln in str(exc).strip().splitlines()
            if ln.strip() and not ln.strip().startswith("For further information visit")]
    return text[-1] if text else type(exc).__name__


def collect_infos(refs: list, model: ModelConfig, prep) -> list[ActorInfo]:
    """The actors' info() results, checked against the model the driver prepared for."""
    import ray

    infos = []
    for i, r in enumerate(refs):
        try:
            infos.append(ray.get(r))
        except Exception as e:
            raise HarvestError(
                f"actor {i} could not load the engine for model.path={model.path!r}: "
                f"{root_cause(e)}"
            ) from None
    for inf in infos:
        if inf.width != prep.width or inf.n_layers != prep.n_layers:
            raise HarvestError(
                f"actor {inf.index} loaded a model of width {inf.width} x {inf.n_layers} "
                f"layers, the config of {model.path} says {prep.width} x {prep.n_layers}")
    return infos


CLOSE_WAIT_S = 45.0  # the actors' engines close in parallel; a hung one is killed after this


def kill_all(handles: list, close_first: bool = True) -> None:
    """Close the actors' engines (`close_first`: vLLM's executor and its ranks unlink their
    /dev/shm queues, ours the arena and step ring; a killed process leaves them), then kill the
    actors and remove their placement groups (see Actors)."""
    import ray

    if close_first and handles:
        refs = []
        # an actor never placed has no process and no engine: its close would only wait out
        # CLOSE_WAIT_S in the queue (a run stopped at ray.start_timeout_s)
        for a in [a for a in handles if not _never_placed(a)]:
            try:
                refs.append(a.close.remote())
            except Exception:  # noqa: BLE001 -- an actor already gone
                pass
        try:
            ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=CLOSE_WAIT_S)
            if waiting:
                log.warning("%d actor(s) did not close their engine in %.0f s: killed",
                            len(waiting), CLOSE_WAIT_S)
        except Exception as e:  # noqa: BLE001 -- killing below is what matters
            log.debug("closing actors: %s", e)
    for a in handles:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
    groups = getattr(handles, "groups", None)   # Actors' placement groups
    if groups:
        from ray.util.placement_group import remove_placement_group

        for pg in groups:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 -- a group gone with its job already
                pass
