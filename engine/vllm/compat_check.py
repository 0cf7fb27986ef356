"""`check()` / `require()`: the installed vLLM against the internals engine/vllm/compat.py lists.

compat.py's sibling, split from it to keep each under ~400 lines: compat.py reads the internals a
capture needs, this module verifies they are still where vLLM 0.32.0 (`compat.VLLM_CHECKED`) had
them, by class attributes and, for instance attributes that cannot be checked on a class, by the
assignments in the source the installed vLLM ships. compat.py's docstring stays the one list of
every internal either module touches; a new internal goes in both (read there, checked here).
"""

from __future__ import annotations

import inspect

from .compat import (VLLM_CHECKED, VLLMIncompatible, installed_version, v1_runner_classes,
                     worker_classes)

# Attributes the runner's __init__ must create (instance attributes cannot be checked on the class;
# their assignments are found in the source the installed vLLM ships).
_RUNNER_ATTRS = ("self.input_batch = ", "self.positions = ", "self.input_ids = ",
                 "self.execute_model_state")
_INPUT_BATCH_ATTRS = ("req_ids", "num_reqs", "num_computed_tokens_cpu", "generators")


def check() -> list[str]:
    """Names of the internals compat.py lists that the installed vLLM lacks (empty: compatible)."""
    missing: list[str] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            missing.append(what)

    try:
        runners = v1_runner_classes()
        workers = worker_classes()
    except ImportError as e:
        return [f"import: {e}"]
    gpu, cpu = runners["gpu"], runners["cpu"]
    for name in ("load_model", "execute_model", "get_model", "sample_tokens", "_bookkeeping_sync"):
        need(callable(getattr(gpu, name, None)), f"GPUModelRunner.{name}")
    need("load_model" in cpu.__dict__, "CPUModelRunner.load_model (own override)")
    try:
        if callable(getattr(gpu, "execute_model", None)):
            need("scheduler_output" in inspect.signature(gpu.execute_model).parameters,
                 "GPUModelRunner.execute_model(scheduler_output, ...)")
        src = inspect.getsource(gpu.__init__)
        for a in _RUNNER_ATTRS:
            need(a in src, f"GPUModelRunner.__init__: {a.strip(' =')}")
        # snapshot_generators / rewind_discarded_generators: the rewind they replace on CPU
        src = inspect.getsource(gpu._bookkeeping_sync)
        need("discard_request_mask.np" in src and "set_offset" in src,
             "GPUModelRunner._bookkeeping_sync rewinds discarded seeded generators")
    except (OSError, TypeError):
        missing.append("GPUModelRunner source (cannot inspect)")
    try:
        from vllm.v1.worker.gpu_input_batch import InputBatch

        src = inspect.getsource(InputBatch)
        for a in _INPUT_BATCH_ATTRS:
            need(f"self.{a}" in src or f"def {a}" in src, f"InputBatch.{a}")
    except (ImportError, OSError) as e:
        missing.append(f"InputBatch: {e}")
    gw, cw = workers["gpu"], workers["cpu"]
    need(callable(getattr(gw, "_make_model_runner", None)), "Worker._make_model_runner")
    need("init_device" in cw.__dict__, "CPUWorker.init_device")
    try:
        src = inspect.getsource(cw.init_device)
        need("self.model_runner = CPUModelRunner(" in src, "CPUWorker.init_device builds CPUModelRunner")
    except (OSError, TypeError):
        missing.append("CPUWorker.init_device source")
    try:
        from vllm.v1.core.sched.output import SchedulerOutput

        fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
        for f in ("num_scheduled_tokens", "total_num_scheduled_tokens"):
            need(f in fields, f"SchedulerOutput.{f}")
    except ImportError as e:
        missing.append(f"SchedulerOutput: {e}")
    try:
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.engine.input_processor import InputProcessor

        need("return req_id" in inspect.getsource(LLMEngine.add_request),
             "LLMEngine.add_request returns the internal request id")
        need(callable(getattr(InputProcessor, "assign_request_id", None)),
             "InputProcessor.assign_request_id")
    except (ImportError, OSError) as e:
        missing.append(f"LLMEngine: {e}")
    try:  # tensor parallel: the groups parallel_ranks / tp_spread read, the pass turned off
        from vllm.config.compilation import PassConfig
        from vllm.distributed import parallel_state as ps
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor

        for f in ("get_tp_group", "get_pp_group"):
            need(callable(getattr(ps, f, None)), f"vllm.distributed.parallel_state.{f}")
        need("fuse_allreduce_rms" in getattr(PassConfig, "__dataclass_fields__", {})
             or hasattr(PassConfig, "fuse_allreduce_rms"), "PassConfig.fuse_allreduce_rms")
        need("self.is_failed" in inspect.getsource(MultiprocExecutor.__init__)
             or "is_failed" in inspect.getsource(MultiprocExecutor),
             "MultiprocExecutor.is_failed (a worker died)")
        src = inspect.getsource(MultiprocExecutor._get_output_rank)
        need("world_size" in src and "tensor_parallel_size" in src,
             "MultiprocExecutor._get_output_rank (TP rank 0 of the last PP stage)")
        # shared destinations (engine/capture/shmdest.py): finished ids leave the rank's table, reuse
        # waits for the steps still in flight
        from vllm.config import VllmConfig
        from vllm.v1.core.sched.output import SchedulerOutput

        need("finished_req_ids" in getattr(SchedulerOutput, "__dataclass_fields__", {}),
             "SchedulerOutput.finished_req_ids")
        need(isinstance(getattr(VllmConfig, "max_concurrent_batches", None), property),
             "VllmConfig.max_concurrent_batches")
        # sharded points (compat.row_parallel_input, compat.tp_gather_columns)
        from vllm.model_executor.layers.linear import RowParallelLinear

        src = inspect.getsource(RowParallelLinear)
        for a in ("self.input_is_parallel = ", "self.input_size_per_partition = ",
                  "start_idx = self.tp_rank * shard_size"):
            need(a in src, f"RowParallelLinear: {a.strip(' =')}")
        need("dim" in inspect.signature(ps.GroupCoordinator.all_gather).parameters,
             "GroupCoordinator.all_gather(input_, dim)")
    except (ImportError, OSError, AttributeError) as e:
        missing.append(f"tensor parallel internals: {e}")
    try:
        from vllm.config import ParallelConfig, CompilationConfig, SchedulerConfig

        for cls, f in ((ParallelConfig, "worker_cls"), (CompilationConfig, "cudagraph_mode"),
                       (CompilationConfig, "cudagraph_capture_sizes"),
                       (SchedulerConfig, "async_scheduling")):
            need(f in getattr(cls, "__dataclass_fields__", {}) or hasattr(cls, f),
                 f"{cls.__name__}.{f}")
    except ImportError as e:
        missing.append(f"vllm.config: {e}")
    return missing


def require() -> None:
    """Refuse to start a capture engine on a vLLM whose internals moved."""
    missing = check()
    if missing:
        raise VLLMIncompatible(
            f"vLLM {installed_version()} lacks internals the capture engine was checked against "
            f"on {VLLM_CHECKED}: {'; '.join(missing)}. Pin vllm=={VLLM_CHECKED} or port "
            "engine/vllm/compat.py and engine/vllm/compat_check.py (and docs/engine.md's notes on runner "
            "internals)")
