"""Worker side of the vLLM backend: install taps at model load, move rows out after each step.

The patch goes on vLLM's V1 model runner class (`GPUModelRunner`, which the CPU runner inherits):
- `load_model`: right after the weights load and *before* the warm-up compile, wrap the decoder
  layers with freeze taps (taps.install_freeze). Installing later would be too late: the compiled
  graph would not contain them.
- `execute_model`: after the forward of a step, copy each request's rows out of the tap buffer
  straight into the consumer's per-request host tensor. The row order is read from the runner's own
  state for that step (`input_batch.req_ids` with the scheduler's counts, and the `positions`
  buffer the model was fed), never reconstructed outside: a dict order guessed elsewhere is how
  another project attached most rows to the wrong request.

The patch is inert unless the engine's `additional_config` carries a "harvest" entry, and it is
applied both in the calling process (engine core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0) and,
through `worker_extension_cls`, in any worker process vLLM spawns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .addresses import Address, FreezeSet
from . import taps as tapmod
from . import vllm_probe

# One engine per process (a second vLLM engine does not fit in memory here anyway); the capture loop
# in the same process finds the worker's state through this slot.
ACTIVE: "HarvestState | None" = None
_PATCHED = False
_LOCK = threading.Lock()


@dataclass
class Dest:
    """Where one request's rows go: `acts[:, pos]` for every captured position."""

    acts: torch.Tensor  # [n_points, n_prompt, width] host
    filled: int = 0


@dataclass
class HarvestState:
    taps: tapmod.TapSet
    layers: object
    n_layers: int
    mode: str  # "freeze" | "hooked"
    max_tokens: int = 0  # rows per step (max_num_batched_tokens): the tap buffer's length
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = torch.device("cpu")
    dests: dict[str, Dest] = field(default_factory=dict)
    steps: int = 0
    rows: int = 0
    stray_rows: int = 0  # rows of requests nobody asked to capture (e.g. decode tokens)
    hook_handles: list = field(default_factory=list)
    # Device-to-host overlap (CUDA only): rows of step k are copied into pinned staging
    # asynchronously and scattered on the host when step k+1 arrives (or at drain).
    pending: list = field(default_factory=list)
    staging: list = field(default_factory=list)
    pos_staging: list = field(default_factory=list)
    events: list = field(default_factory=list)
    flip: int = 0


def base_request_id(internal: str) -> str:
    """vLLM appends `-<8 hex>` to the caller's request id; strip it to find our destination."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


def _harvest_config(runner) -> dict | None:
    extra = getattr(runner.vllm_config, "additional_config", None) or {}
    return extra.get("harvest") if isinstance(extra, dict) else None


def _n_layers(model_config) -> int:
    return model_config.get_total_num_hidden_layers()


def _runner_classes():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)  # it overrides load_model without calling super()
    except ImportError:
        pass
    return classes


def install_patch() -> None:
    """Patch vLLM's V1 runner classes once per process (idempotent)."""
    global _PATCHED
    with _LOCK:
        if _PATCHED:
            return
        for cls in _runner_classes():
            if "load_model" in cls.__dict__:
                cls.load_model = _wrap_load(cls.__dict__["load_model"])
            if "execute_model" in cls.__dict__:
                cls.execute_model = _wrap_exec(cls.__dict__["execute_model"])
        _PATCHED = True


def _wrap_load(orig):
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        cfg = _harvest_config(self)
        if cfg is not None and not getattr(self, "_harvest_ready", False):
            _setup(self, cfg)
            self._harvest_ready = True
        return out

    return load_model


def _wrap_exec(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        out = orig(self, scheduler_output, *args, **kwargs)
        st = ACTIVE
        if st is not None and st.taps.buf is not None and scheduler_output.total_num_scheduled_tokens:
            _harvest_step(self, st, scheduler_output)
        return out

    return execute_model


def _setup(runner, cfg: dict) -> None:
    global ACTIVE
    model = runner.get_model()
    n_layers = _n_layers(runner.model_config)
    layers = vllm_probe.probed_trunk(runner, model, n_layers, cfg)  # refuses unverifiable trunks
    width = runner.model_config.get_hidden_size()
    dtype = runner.model_config.dtype
    max_tokens = runner.scheduler_config.max_num_batched_tokens
    mode = cfg["mode"]
    if mode == "freeze":
        fs = FreezeSet(tuple(map(Address.parse, cfg["reads"])), tuple(map(Address.parse, cfg["writes"])))
        ts = tapmod.allocate(fs, max_tokens, width, dtype, runner.device)
        tapmod.install_freeze(layers, ts)
    else:  # hooked: buffers are (re)allocated per capture call for the points it asks
        ts = tapmod.TapSet((), (), None, {}, width)
    ACTIVE = HarvestState(ts, layers, n_layers, mode, max_tokens, dtype, runner.device)


def set_hooked_points(points: tuple[Address, ...]) -> None:
    """Hooked mode: (re)install Python hooks for exactly these points."""
    st = ACTIVE
    for h in st.hook_handles:
        h.remove()
    st.hook_handles = []
    buf = None
    if points:
        buf = torch.zeros(len(points), st.max_tokens, st.taps.width, dtype=st.dtype, device=st.device)
    st.taps = tapmod.TapSet(tuple(points), (), buf, {}, st.taps.width)
    if points:
        st.hook_handles = tapmod.install_hooks(st.layers, st.taps)


def _harvest_step(runner, st: HarvestState, so) -> None:
    n = so.total_num_scheduled_tokens
    req_ids = list(runner.input_batch.req_ids[: runner.input_batch.num_reqs])
    counts = [so.num_scheduled_tokens[r] for r in req_ids]
    if sum(counts) != n:
        raise RuntimeError(f"step row count mismatch: {sum(counts)} scheduled vs {n} forwarded")
    buf = st.taps.buf
    if buf.device.type == "cuda":
        _harvest_cuda(runner, st, req_ids, counts, n)
        return
    positions = runner.positions[:n].tolist()
    _scatter(st, buf, req_ids, counts, positions)


def _scatter(st: HarvestState, buf, req_ids, counts, positions) -> None:
    row = 0
    for rid, c in zip(req_ids, counts):
        d = st.dests.get(base_request_id(rid))
        p0 = positions[row]
        if d is None or p0 >= d.acts.shape[1]:
            st.stray_rows += c
        else:
            c_prompt = min(c, d.acts.shape[1] - p0)
            if positions[row + c - 1] != p0 + c - 1:
                raise RuntimeError(f"request {rid}: non-contiguous positions in one step")
            d.acts[:, p0 : p0 + c_prompt].copy_(buf[:, row : row + c_prompt])
            d.filled += c_prompt
            st.stray_rows += c - c_prompt
        row += c
    st.steps += 1
    st.rows += row


def _harvest_cuda(runner, st: HarvestState, req_ids, counts, n) -> None:
    """Copy rows device->pinned host without waiting; scatter them when the next step comes."""
    drain_pending(st)
    if not st.staging:
        shape = st.taps.buf.shape
        st.staging = [torch.empty(shape, dtype=st.taps.buf.dtype, pin_memory=True) for _ in range(2)]
        st.pos_staging = [torch.empty(shape[1], dtype=torch.int64, pin_memory=True) for _ in range(2)]
        st.events = [torch.cuda.Event() for _ in range(2)]
    k = st.flip
    st.flip ^= 1
    st.staging[k][:, :n].copy_(st.taps.buf[:, :n], non_blocking=True)
    st.pos_staging[k][:n].copy_(runner.positions[:n], non_blocking=True)
    st.events[k].record()
    st.pending.append((k, req_ids, counts, n))


def drain_pending(st: HarvestState) -> None:
    while st.pending:
        k, req_ids, counts, n = st.pending.pop(0)
        st.events[k].synchronize()
        _scatter(st, st.staging[k], req_ids, counts, st.pos_staging[k][:n].tolist())
