"""`check()` / `require()`: a vLLM's source against the internals engine/vllm/compat.py lists.

compat.py's sibling: compat.py reads the internals a capture needs; this module verifies that a
vLLM still has them where vLLM 0.32.0 (`compat.VLLM_CHECKED`) had them, by reading its source:
each need below names a module file, a class, and a member (a method with the parameters we pass,
an attribute its `__init__` assigns, a dataclass or NamedTuple field, a snippet of the behaviour
we rely on). Reading source, not importing, checks a vLLM that is not installed as well as the
installed one: `check_source(root)` on an unpacked wheel (vLLM 0.34.0, which has no V1 runner,
is checked this way: tests/engine/test_engine_compat.py), `check()` on the installed package.
compat.py's docstring stays the one list of every internal either module touches; a new internal
goes in both (read there, checked here).

Each need says which runners rely on it: `require("v2")` refuses an engine only for what V2
needs, so a vLLM without V1 passes when V2 is chosen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .compat import VLLM_CHECKED, VLLMIncompatible, installed_version

BOTH = ("v1", "v2")


@dataclass(frozen=True)
class Need:
    """One internal: `kind` is "class" (the class exists; `bases` it must name), "method" (a
    def with `params`), "attr" (assigned as `self.<member> = ...`, or a def/property/field of
    that name), "field" (an annotated field of a dataclass/NamedTuple, or a property), "text"
    (`text` appears in the member's source, or in the module's when `member` is None)."""

    module: str
    cls: str | None
    member: str | None
    kind: str
    params: tuple[str, ...] = ()
    text: str = ""
    bases: tuple[str, ...] = ()
    runners: tuple[str, ...] = BOTH

    @property
    def name(self) -> str:
        where = f"{self.cls}.{self.member}" if self.cls and self.member else self.cls or self.member
        if self.kind == "method" and self.params:
            where += f"({', '.join(self.params)}, ...)"
        if self.kind == "text":
            where = f"{where or self.module}: {self.text.strip(' =(')}"
        return where


_V1 = ("v1",)
_V2 = ("v2",)
_GMR1 = "vllm/v1/worker/gpu_model_runner.py"
_GMR2 = "vllm/v1/worker/gpu/model_runner.py"
_IB2 = "vllm/v1/worker/gpu/input_batch.py"

NEEDS: tuple[Need, ...] = (
    # -- Model Runner V1: the persistent batch after execute_model (compat._v1_step_layout) ----------
    Need(_GMR1, "GPUModelRunner", "load_model", "method", runners=_V1),
    Need(_GMR1, "GPUModelRunner", "execute_model", "method", ("scheduler_output",), runners=_V1),
    Need(_GMR1, "GPUModelRunner", "get_model", "method", runners=_V1),
    Need(_GMR1, "GPUModelRunner", "sample_tokens", "method", runners=_V1),
    Need(_GMR1, "GPUModelRunner", "__init__", "text", text="self.input_batch = ", runners=_V1),
    Need(_GMR1, "GPUModelRunner", "__init__", "text", text="self.positions = ", runners=_V1),
    Need(_GMR1, "GPUModelRunner", "__init__", "text", text="self.input_ids = ", runners=_V1),
    Need(_GMR1, "GPUModelRunner", "__init__", "text", text="self.execute_model_state", runners=_V1),
    # snapshot_generators / rewind_discarded_generators: the rewind they replace on CPU
    Need(_GMR1, "GPUModelRunner", "_bookkeeping_sync", "text", text="discard_request_mask.np",
         runners=_V1),
    Need(_GMR1, "GPUModelRunner", "_bookkeeping_sync", "text", text="set_offset", runners=_V1),
    Need("vllm/v1/worker/cpu_model_runner.py", "CPUModelRunner", "load_model", "method",
         runners=_V1),
    *(Need("vllm/v1/worker/gpu_input_batch.py", "InputBatch", a, "attr", runners=_V1)
      for a in ("req_ids", "num_reqs", "num_computed_tokens_cpu", "generators")),
    Need("vllm/v1/worker/cpu_worker.py", "CPUWorker", "init_device", "text",
         text="self.model_runner = CPUModelRunner(", runners=_V1),
    # -- Model Runner V2: the step's own InputBatch (compat._v2_step_layout) -----------------------
    Need(_GMR2, "GPUModelRunner", "load_model", "method", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "execute_model", "method", ("scheduler_output", "dummy_run"),
         runners=_V2),
    Need(_GMR2, "GPUModelRunner", "execute_model", "text", text="self.prepare_inputs(", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "_dummy_run", "text", text="dummy_run=True", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "prepare_inputs", "method", ("scheduler_output",), runners=_V2),
    Need(_GMR2, "GPUModelRunner", "prepare_inputs", "text", text="InputBatch(", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "get_model", "method", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "__init__", "text", text="self.scheduler_config = ", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "__init__", "text", text="self.model_config = ", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "__init__", "text", text="self.device = ", runners=_V2),
    # requests in sorted order, decode first: the row map follows req_ids, whatever the order
    Need(_GMR2, None, "sort_batch_req_ids", "method", runners=_V2),
    *(Need(_IB2, "InputBatch", f, "field", runners=_V2)
      for f in ("req_ids", "num_reqs", "num_scheduled_tokens", "num_tokens", "query_start_loc_np",
                "num_computed_tokens_np", "positions", "input_ids")),
    # what a tap may assume under V2's CUDA graphs and async scheduling (docs/engine.md): graphs
    # replay the forward as recorded (FULL and piecewise), padding follows the real tokens, and
    # the fed positions/ids are device buffers written on the stream
    Need("vllm/v1/worker/gpu/cudagraph_utils.py", "CudaGraphManager", "run_fullgraph", "method",
         runners=_V2),
    Need("vllm/v1/worker/gpu/cudagraph_utils.py", "CudaGraphManager", "run_pw_graph", "method",
         runners=_V2),
    Need(_GMR2, "GPUModelRunner", "prepare_inputs", "text",
         text="query_start_loc_np[num_reqs + 1 :] = num_tokens", runners=_V2),
    Need(_IB2, "InputBuffers", "__init__", "text",
         text="self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)",
         runners=_V2),
    Need("vllm/v1/worker/cpu/model_runner.py", "CPUModelRunner", None, "class",
         bases=("GPUModelRunner",), runners=_V2),
    Need("vllm/v1/worker/cpu_worker.py", None, None, "text",
         text="vllm.v1.worker.cpu.model_runner", runners=_V2),
    Need("vllm/v1/worker/cpu_worker.py", "CPUWorker", "init_device", "text",
         text="CPUModelRunner", runners=_V2),
    # -- both: workers, the front end, plugins ------------------------------------------------------
    Need("vllm/v1/worker/gpu_worker.py", "Worker", "_make_model_runner", "method"),
    Need("vllm/v1/worker/cpu_worker.py", "CPUWorker", "init_device", "method"),
    Need("vllm/v1/core/sched/output.py", "SchedulerOutput", "num_scheduled_tokens", "field"),
    Need("vllm/v1/core/sched/output.py", "SchedulerOutput", "total_num_scheduled_tokens", "field"),
    Need("vllm/v1/core/sched/output.py", "SchedulerOutput", "finished_req_ids", "field"),
    Need("vllm/v1/engine/llm_engine.py", "LLMEngine", "add_request", "text", text="return req_id"),
    Need("vllm/v1/engine/input_processor.py", "InputProcessor", "assign_request_id", "method"),
    Need("vllm/plugins/__init__.py", None, "load_general_plugins", "method"),
    Need("vllm/triton_utils/__init__.py", None, None, "text", text="HAS_TRITON"),
    # -- tensor parallel: the groups parallel_ranks / tp_spread read, the pass turned off ----------
    Need("vllm/distributed/parallel_state.py", None, "get_tp_group", "method"),
    Need("vllm/distributed/parallel_state.py", None, "get_pp_group", "method"),
    Need("vllm/distributed/parallel_state.py", "GroupCoordinator", "all_gather", "method",
         ("input_", "dim")),
    Need("vllm/config/compilation.py", "PassConfig", "fuse_allreduce_rms", "field"),
    Need("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor", None, "text",
         text="self.is_failed"),
    # message_queue_shm: the queues' shared memory, removed at close when a rank died
    Need("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor", None, "text",
         text="self.rpc_broadcast_mq = MessageQueue("),
    Need("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor", None, "text",
         text="self.response_mqs.append(local_message_queue)"),
    Need("vllm/distributed/device_communicators/shm_broadcast.py", "MessageQueue", None, "text",
         text="self.buffer = ShmRingBuffer("),
    Need("vllm/distributed/device_communicators/shm_broadcast.py", "ShmRingBuffer", None, "text",
         text="self.shared_memory = shared_memory.SharedMemory("),
    Need("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor", "_get_output_rank", "text",
         text="tensor_parallel_size"),
    Need("vllm/config/vllm.py", "VllmConfig", "max_concurrent_batches", "field"),
    # expert_indices / expert_weights (compat.moe_routers): the router's choice, as the runner
    # hands it to the experts
    Need("vllm/model_executor/layers/fused_moe/runner/moe_runner.py", "MoERunner", "__init__",
         "text", text="self.router = router"),
    Need("vllm/model_executor/layers/fused_moe/runner/moe_runner.py", "MoERunner", "is_monolithic",
         "attr"),
    Need("vllm/model_executor/layers/fused_moe/runner/moe_runner.py", "MoERunner", None, "text",
         text="topk_weights, topk_ids = self.router.select_experts("),
    Need("vllm/model_executor/layers/fused_moe/router/fused_moe_router.py", "FusedMoERouter",
         "select_experts", "method", ("hidden_states", "router_logits")),
    # sharded points (compat.row_parallel_input, compat.tp_gather_columns)
    Need("vllm/model_executor/layers/linear.py", "RowParallelLinear", None, "text",
         text="self.input_is_parallel = "),
    Need("vllm/model_executor/layers/linear.py", "RowParallelLinear", None, "text",
         text="self.input_size_per_partition = "),
    Need("vllm/model_executor/layers/linear.py", "RowParallelLinear", None, "text",
         text="start_idx = self.tp_rank * shard_size"),
    # mlp_pre / mlp_pre_linear (compat.column_parallel_output): [gate shard | up shard] per rank
    Need("vllm/model_executor/layers/linear.py", "ColumnParallelLinear", "gather_output", "attr"),
    Need("vllm/model_executor/layers/linear.py", "ColumnParallelLinear",
         "output_size_per_partition", "attr"),
    Need("vllm/model_executor/layers/linear.py", "MergedColumnParallelLinear", "output_sizes",
         "attr"),
    Need("vllm/model_executor/layers/linear.py", "MergedColumnParallelLinear", None, "text",
         text="shard_offset = sum(self.output_sizes[:loaded_shard_id])"),
    # q / k / v (compat.qkv_split): the attention kernel's inputs, split as QKVParallelLinear
    # splits the heads (KV heads replicated when fewer than ranks)
    *(Need("vllm/model_executor/layers/linear.py", "QKVParallelLinear", a, "attr")
      for a in ("num_heads", "num_kv_heads", "head_size", "v_head_size", "num_kv_head_replicas")),
    Need("vllm/model_executor/layers/linear.py", "QKVParallelLinear", None, "text",
         text="shard_rank = self.tp_rank // self.num_kv_head_replicas"),
    Need("vllm/model_executor/layers/attention/attention.py", "Attention", "forward", "method",
         ("query", "key", "value")),
    # logprob.0 / entropy.0 (engine/vllm/scorestep.py): the step's final hidden states that
    # execute_model leaves for sample_tokens, the prompts the scheduler sends once, and the
    # logits processor's softcap and vocab gather behind every model's compute_logits
    Need(_GMR1, "ExecuteModelState", "hidden_states", "field", runners=_V1),
    Need(_GMR1, "GPUModelRunner", "execute_model", "text",
         text="self.execute_model_state = ExecuteModelState(", runners=_V1),
    Need(_GMR2, "ExecuteModelState", "hidden_states", "field", runners=_V2),
    Need(_GMR2, "GPUModelRunner", "execute_model", "text",
         text="self.execute_model_state = ExecuteModelState(", runners=_V2),
    Need("vllm/v1/core/sched/output.py", "SchedulerOutput", "scheduled_new_reqs", "field"),
    *(Need("vllm/v1/core/sched/output.py", "NewRequestData", f, "field")
      for f in ("req_id", "prompt_token_ids")),
    Need("vllm/model_executor/layers/logits_processor.py", "LogitsProcessor", "forward", "text",
         text="self.soft_cap"),
    Need("vllm/model_executor/layers/logits_processor.py", "LogitsProcessor", "_gather_logits",
         "text", text="tensor_model_parallel_all_gather"),
    # -- settings read for reports and set for capture -------------------------------------------------
    Need("vllm/config/parallel.py", "ParallelConfig", "worker_cls", "field"),
    Need("vllm/config/parallel.py", "ParallelConfig", "use_ubatching", "field"),
    Need("vllm/config/compilation.py", "CompilationConfig", "cudagraph_mode", "field"),
    Need("vllm/config/compilation.py", "CompilationConfig", "cudagraph_capture_sizes", "field"),
    Need("vllm/config/scheduler.py", "SchedulerConfig", "async_scheduling", "field"),
)


class SourceTree:
    """The Python source of one vLLM: `root` holds the `vllm/` package folder (an installed
    site-packages, or an unpacked wheel)."""

    def __init__(self, root: "str | Path"):
        self.root = Path(root)
        # parsed once per tree; the tree (and its ~10^5 AST nodes) goes with the check that made it
        self._modules: "dict[str, tuple[str, ast.Module] | None]" = {}

    def module(self, rel: str) -> "tuple[str, ast.Module] | None":
        if rel not in self._modules:
            path = self.root / rel
            src = path.read_text(encoding="utf-8") if path.is_file() else None
            self._modules[rel] = None if src is None else (src, ast.parse(src))
        return self._modules[rel]

    def find(self, rel: str, cls: str | None, member: str | None):
        """(source, node) of the class, or of the member (a def anywhere in the class, or at
        module level when `cls` is None); None when missing."""
        got = self.module(rel)
        if got is None:
            return None
        src, tree = got
        scope: ast.AST = tree
        if cls is not None:
            scope = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
            if scope is None:
                return None
            if member is None:
                return src, scope
        for n in scope.body:  # type: ignore[attr-defined]
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == member:
                return src, n
        return None


def _params(fn) -> set[str]:
    a = fn.args
    return {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}


def _has_field(cls: ast.ClassDef, name: str) -> bool:
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            return True
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return True
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
            return True   # a property
    return False


def _assigns_self(cls: ast.ClassDef, name: str) -> bool:
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
            n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if (isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name)
                    and t.value.id == "self"):
                return True
    return False


def _met(tree: SourceTree, need: Need) -> bool:
    if need.kind == "text" and need.cls is None and need.member is None:
        got = tree.module(need.module)
        return got is not None and need.text in got[0]
    if need.kind in ("class", "field", "attr") or (need.kind == "text" and need.member is None):
        found = tree.find(need.module, need.cls, None)
        if found is None:
            return False
        src, cls = found
        if need.kind == "class":
            names = {ast.unparse(b).rsplit(".", 1)[-1] for b in cls.bases}
            return set(need.bases) <= names
        if need.kind == "field":
            return _has_field(cls, need.member)
        if need.kind == "attr":
            return _has_field(cls, need.member) or _assigns_self(cls, need.member)
        return need.text in (ast.get_source_segment(src, cls) or "")
    found = tree.find(need.module, need.cls, need.member)
    if found is None:
        return False
    src, fn = found
    if need.kind == "method":
        return set(need.params) <= _params(fn)
    return need.text in (ast.get_source_segment(src, fn) or "")


def check_source(root: "str | Path", runners: "tuple[str, ...] | str" = BOTH) -> list[str]:
    """Names of the internals the given runners rely on that the vLLM source under `root` lacks
    (empty: compatible), each as `module: Class.member`."""
    want = (runners,) if isinstance(runners, str) else tuple(runners)
    tree = SourceTree(root)
    return [f"{n.module}: {n.name}" for n in NEEDS
            if set(n.runners) & set(want) and not _met(tree, n)]


def installed_root() -> Path:
    """The folder holding the installed `vllm/` package (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        raise VLLMIncompatible("vLLM is not installed")
    return Path(spec.origin).parent.parent


def check(runner: "str | None" = None) -> list[str]:
    """The installed vLLM against what `runner` ("v1"/"v2"; default both) relies on: read once
    per process (every engine start asks; the installed source does not change under it)."""
    return list(_check_installed(installed_root(), BOTH if runner is None else (runner,)))


@cache
def _check_installed(root: Path, runners: "tuple[str, ...]") -> "tuple[str, ...]":
    return tuple(check_source(root, runners))


def require(runner: "str | None" = None) -> None:
    """Refuse to start a capture engine on a vLLM whose internals moved."""
    missing = check(runner)
    if missing:
        which = f" (Model Runner {runner.upper()})" if runner else ""
        raise VLLMIncompatible(
            f"vLLM {installed_version()} lacks internals the capture engine{which} was checked "
            f"against on {VLLM_CHECKED}: {'; '.join(missing)}. Pin vllm=={VLLM_CHECKED} or port "
            "engine/vllm/compat.py and engine/vllm/compat_check.py (and docs/engine.md's notes on runner "
            "internals)")
