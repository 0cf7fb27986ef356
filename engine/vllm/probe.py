"""Run the block-semantics probe (engine/capture/probe.py) inside vLLM's worker, right after the weights
load and before vLLM compiles or warms up the model, in every capture mode (freeze and hooked).

vLLM internals this file touches, all checked against vLLM 0.32.0 (CPU and CUDA builds); the
engine's other vLLM internals live in engine/vllm/rowmap.py and engine/vllm/backend.py:
- `vllm.forward_context.set_forward_context(None, vllm_config, num_tokens=n, skip_compiled=True)`:
  with `skip_compiled` a `@support_torch_compile` model runs its plain forward instead of
  compiling (compilation/decorators.py `__call__`), so the probe neither triggers the compile nor
  leaves its temporary wrappers in a traced graph. The context also carries what MoE layers look
  up by name (`no_compile_layers`).
- `vllm.model_executor.layers.attention.Attention` (`num_heads`, `num_kv_heads`, `head_size_v`;
  `forward(query, key, value, output_shape=None, ...)`): at load time there is no KV cache and no
  attention metadata, and with metadata None the CPU kernel returns an uninitialised buffer
  (v1/attention/backends/cpu_attn.py "For warming-up"). The probe therefore swaps each instance's
  forward for the exact attention of one-token sequences (softmax over one key is 1, so each
  query head's output is its own token's value head), and feeds one-token sequences at position 0.
  Vllm's Transformers backend routes HF attention through the same `Attention` instances.
- `vllm.model_executor.layers.mamba.mamba_mixer2.MambaMixer2` (hybrid trunks: FalconH1,
  Granite-4, ...; `conv_ssm_forward(projected_states, output)`, called through the
  `vllm.mamba_mixer2` custom op, with `conv_weights` [dim, kernel], `conv1d.bias`, `activation`,
  `A`, `D`, `dt_bias`, `num_heads`, `head_dim`, `n_groups`, `tp_size`,
  `tped_intermediate_size`/`tped_conv_size`/`tped_dt_size`, `split_hidden_states_B_C_fn`):
  without attention metadata it takes vLLM's profile-run path, which returns without writing
  `output`, a `torch.empty` buffer: the block then carries whatever that memory held (a NaN
  at layer 3 of a tiny FalconH1, refused as I2). The probe swaps it for the exact mixer of a
  one-token sequence from a zero state, as it does for attention.
- the MoE layers' routers (`compat.moe_routers`, for expert_indices / expert_weights);
- the runner's `vllm_config` (`additional_config` for the opt-in) and
  `model_config.get_vocab_size()`, and the model's `forward(input_ids, positions)` /
  `embed_input_ids(ids)`; width and device come from engine/vllm/compat.py (`runner_geometry`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from . import compat
from ..capture import probe
from ..capture.block_stream import Trunk
from ..capture.taps import find_layers

PROBE_TOKENS = 16
OPT_IN_KEY = "harvest_unverified_trunk"  # additional_config key: capture from a refused trunk


def _one_token_attention(self, query, key, value, output_shape=None, output_dtype=None, **_):
    n = query.shape[0]
    shape = output_shape or (n, self.num_heads * self.head_size_v)
    dtype = output_dtype or query.dtype
    if value is None or value.numel() != n * self.num_kv_heads * self.head_size_v:
        return torch.zeros(shape, dtype=dtype, device=query.device)  # no value to pass through
    v = value.reshape(n, self.num_kv_heads, self.head_size_v)
    v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
    return v.reshape(shape).to(dtype)


def _one_token_mamba2(self, projected_states, output):
    """MambaMixer2.conv_ssm_forward for one-token sequences from a zero state (the probe's
    inputs): the causal conv sees its own token only (the kernel's last tap, the bias, then the
    activation); the SSM state after one step is dt * x (outer) B, so the output is
    (C . B) * dt * x + D * x per head. Written into `output` as the kernel writes it."""
    import torch.nn.functional as F

    n = projected_states.shape[0]
    xbc, dt = torch.split(projected_states[..., self.tped_intermediate_size:],
                          [self.tped_conv_size, self.tped_dt_size], dim=-1)
    xbc = xbc.float() * self.conv_weights[:, -1].float()
    if self.conv1d.bias is not None:
        xbc = xbc + self.conv1d.bias.float()
    if self.activation in ("silu", "swish"):
        xbc = F.silu(xbc)
    elif self.activation is not None:
        raise probe.TrunkRefused(f"{type(self).__name__}: the probe knows no conv activation "
                                 f"{self.activation!r}")
    x, B, C = self.split_hidden_states_B_C_fn(xbc)
    heads, groups = self.num_heads // self.tp_size, self.n_groups // self.tp_size
    x = x.reshape(n, heads, self.head_dim)
    cb = (B.reshape(n, groups, -1) * C.reshape(n, groups, -1)).sum(-1)
    cb = cb.repeat_interleave(heads // groups, dim=1)                      # [n, heads]
    dt = F.softplus(dt.float() + self.dt_bias.float())
    y = x * (dt * cb + self.D.float())[..., None]
    output[:n].copy_(y.reshape(n, -1).to(output.dtype))


def _mixers():
    """(class, one-token forward) of the sequence mixers the probe replaces besides attention."""
    try:
        from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    except ImportError:  # a vLLM build without Mamba layers
        return []
    return [(MambaMixer2, "conv_ssm_forward", _one_token_mamba2)]


@contextlib.contextmanager
def _probe_attention(model: torch.nn.Module):
    """Attention and the Mamba-2 mixers of `model` compute their one-token sequences exactly
    while the probe runs (no KV cache, no metadata: see the module docstring). What was there
    before is put back afterwards: under tensor parallelism the replica check runs this after
    the freeze taps wrapped the attention module's forward (q, k, v are its inputs)."""
    from vllm.model_executor.layers.attention import Attention

    swapped = []
    for m in model.modules():
        if isinstance(m, Attention):
            swapped.append((m, "forward", m.__dict__.get("forward")))
            m.forward = _one_token_attention.__get__(m)
        for cls, name, fn in _mixers():
            if isinstance(m, cls):
                swapped.append((m, name, m.__dict__.get(name)))
                setattr(m, name, fn.__get__(m))
    try:
        yield
    finally:
        for m, name, before in reversed(swapped):
            if before is None:
                delattr(m, name)
            else:
                setattr(m, name, before)


def _probe_inputs(runner):
    geometry = compat.runner_geometry(runner)
    vocab = runner.model_config.get_vocab_size()
    ids = torch.linspace(3, vocab - 1, PROBE_TOKENS).long().to(geometry["device"])
    return ids, torch.zeros_like(ids)


# Ranks compute a replicated value with the same kernels on the same all-reduced inputs: equal
# to the bit on CPU. A shard (a rank's partial sum before the all-reduce) differs by the size of
# the value itself. The bound sits far from both and only guards against a reduction whose order
# differs between ranks.
REPLICA_TOL = 1e-2


def require_replicated(runner, model: torch.nn.Module, trunk: Trunk, reads, n_layers: int) -> None:
    """Tensor parallel: prove that every replicated read point is complete and the same on every
    TP rank at the tap (the stream after the all-reduce), so one rank's copy is the whole row
    (points the table marks sharded, q/k/v/z and the MLP's, are column slices by design: they are
    assembled by a gather and checked by engine/vllm/tpshards.py instead). Every rank
    runs one eager probe forward with hooks at exactly the read points (the taps' own readings,
    engine/taps.install_hooks) and the ranks compare what they saw; a point that differs is a
    shard (e.g. a sub-module output before its all-reduce) and is refused at load, on every
    rank alike (all ranks see the same spread), rather than captured as a shard."""
    from vllm.forward_context import set_forward_context

    from ..capture import taps as tapmod
    from ..points import LOGIT_POINTS

    # logprob/entropy are computed from the gathered logits after the forward, on no tap
    reads = [a for a in reads if a.name not in LOGIT_POINTS]
    if not reads:
        return
    ids, positions = _probe_inputs(runner)
    g = compat.runner_geometry(runner)
    widths = read_widths(reads, g)
    width = tapmod.buffer_width(g["width"], widths)
    buf = torch.full((len(reads), len(ids), width), float("nan"), dtype=g["dtype"],
                     device=ids.device)
    ts = tapmod.TapSet(tuple(reads), (), buf, {}, width, widths)
    with torch.inference_mode(), _probe_attention(model):
        handles = tapmod.install_hooks(trunk, ts)
        try:
            with set_forward_context(None, runner.vllm_config, num_tokens=len(ids),
                                     skip_compiled=True):
                model(input_ids=ids, positions=positions)
        finally:
            for h in handles:
                h.remove()
    from .tpshards import sharded

    vals, vwidths = _values(buf, reads, widths)
    kept = [(a, x) for a, x in zip(reads, replica_spread(vals, compat.tp_spread(vals), vwidths))
            if not sharded(a.name)]
    bad = [(str(a), x) for a, x in kept if not x <= REPLICA_TOL]
    trunk.report["tp_replicated"] = {str(a): x for a, x in kept}
    trunk.report["tp_sharded"] = [str(a) for a in reads if sharded(a.name)]
    if bad:
        shown = ", ".join(f"{a} (ranks differ by {x:.3g} of its size)" for a, x in bad[:6])
        raise probe.TrunkRefused(
            f"tensor_parallel_size > 1: {len(bad)} read point(s) are not the same on every "
            f"tensor-parallel rank at the tap, so one rank holds only a shard: {shown}. Capture "
            "resid_post / resid_pre there (the stream is all-reduced), or load the model with "
            "tensor_parallel_size=1")


def _values(buf: torch.Tensor, reads, widths):
    """The probe's rows as float32 values to compare across ranks: a point of 32-bit values
    (expert_indices, expert_weights: engine/capture/packed.py) is unpacked first, since its
    bits read as the engine dtype are not numbers (half of a float32 can be a bfloat16 NaN)."""
    from ..capture.packed import unpack
    from ..points import PACKED

    if not any(a.name in PACKED for a in reads):
        return buf, widths
    vals, out = buf.float().clone(), list(widths)
    for i, a in enumerate(reads):
        if a.name in PACKED:
            v = unpack(buf[i, :, :widths[i]], PACKED[a.name]).float()
            vals[i].fill_(float("nan"))
            vals[i, :, :v.shape[1]] = v
            out[i] = v.shape[1]
    return vals, tuple(out)


def replica_spread(buf: torch.Tensor, spread: torch.Tensor, widths) -> list[float]:
    """Each read's largest spread over the ranks relative to its largest value, measured on its
    own columns only: the NaN-filled buffer is as wide as the widest read, and a narrower point
    (router_logits: one column per expert) leaves the columns past its width unwritten, NaN on
    every rank. A NaN inside a read's own columns (a tap that never ran) stays NaN and fails."""
    out = []
    for i, w in enumerate(widths):
        scale = buf[i, :, :w].float().abs().amax().clamp_min(1e-6)
        out.append(float(spread[i, :, :w].amax() / scale))
    return out


def read_widths(reads, geometry: dict, full: bool = False) -> tuple[int, ...]:
    """Each read's width on this rank (engine/points.py width kinds; a shard's under TP), or
    with `full` the whole row's (what the output rank holds once shards are assembled)."""
    from ..points import BY_NAME, values_per_slot

    kinds = geometry["full_kinds" if full else "kinds"]
    out = []
    for a in reads:
        kind = BY_NAME[a.name].width if a.name in BY_NAME else "d_model"
        w = kinds.get(kind) if kind != "d_model" else geometry["width"]
        if not w:
            raise ValueError(f"{a}: this model's config gives no {kind} width")
        # 32-bit values (logprob, entropy, expert routing) in the engine dtype's elements
        out.append(int(w) * values_per_slot(a.name, geometry["dtype"]))
    return tuple(out)


def probed_trunk(runner, model: torch.nn.Module, n_layers: int, cfg: dict) -> Trunk:
    """The decoder layers of the runner's model, with each block's measured semantics.

    Raises probe.TrunkRefused (at engine load) unless the engine was opted in with
    `additional_config={"harvest_unverified_trunk": True}`.
    """
    from vllm.forward_context import set_forward_context

    layers = find_layers(model, n_layers)
    extra = getattr(runner.vllm_config, "additional_config", None) or {}
    allow = bool(cfg.get("unverified_trunk") or (isinstance(extra, dict) and extra.get(OPT_IN_KEY)))
    geometry = compat.runner_geometry(runner)
    vocab = runner.model_config.get_vocab_size()
    ids = torch.linspace(3, vocab - 1, PROBE_TOKENS).long().to(geometry["device"])
    positions = torch.zeros_like(ids)

    forwards: list[float] = []

    def run() -> torch.Tensor:
        t = time.perf_counter()
        with set_forward_context(None, runner.vllm_config, num_tokens=len(ids), skip_compiled=True):
            out = model(input_ids=ids, positions=positions)
        forwards.append(round(time.perf_counter() - t, 3))
        return out[0] if isinstance(out, (tuple, list)) else out

    def embed() -> torch.Tensor:
        return model.embed_input_ids(ids)

    width = geometry["width"]
    t0 = time.perf_counter()
    with torch.inference_mode(), _probe_attention(model):
        trunk = probe.probe_trunk(layers, run, embed, width, allow_unverified=allow,
                                  widths=geometry["kinds"])
    trunk.report.update(seconds=round(time.perf_counter() - t0, 3), forward_seconds=forwards)
    trunk.routing = compat.moe_routers(layers)   # expert_indices / expert_weights
    return trunk
