"""Taps: where activations are read (and steering vectors written) inside a decoder trunk.

A tap is a slot of one preallocated buffer `[n_reads, max_num_batched_tokens, width]`, written by a
torch custom op that mutates the buffer. Because the op is opaque to dynamo and inductor and its only
effect is a declared mutation, it is traced into vLLM's `torch.compile`d graph and replayed inside
CUDA graphs; a Python forward hook, in contrast, is never called on the compiled path (0 calls
measured on vLLM's CPU build). One buffer for all reads means one strided copy per request per step
moves every layer of that request's rows out (see harvest.py).

Block shapes handled:
- "fused" trunks (vLLM Llama/Qwen decoder layers): `forward(positions, hidden, residual)` returns
  `(hidden, residual)` and the residual add is fused into the *next* layer's norm, so the stream after
  block L is `hidden + residual`; tapping `hidden` alone (the MLP output) would be wrong.
- "stream" trunks (GPT-2 blocks, Hugging Face decoder layers): the block returns the stream itself.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from .addresses import Address, FreezeSet


# Calls of the tap kernels, counted inside the op bodies: on the compiled path they are the only
# Python that runs per layer, so a test can tell "taps ran under compilation" from "hooks ran".
TAP_CALLS = [0]


@torch.library.custom_op("harvest::tap", mutates_args=("buf",))
def tap(x: torch.Tensor, buf: torch.Tensor, slot: int) -> None:
    """buf[slot, :n] = x  (n = rows of this step, padding included; the harvest reads only real rows)."""
    TAP_CALLS[0] += 1
    buf[slot, : x.shape[0]].copy_(x.reshape(x.shape[0], -1))


@tap.register_fake
def _tap_fake(x, buf, slot):
    return None


@torch.library.custom_op("harvest::tap_sum", mutates_args=("buf",))
def tap_sum(x: torch.Tensor, r: torch.Tensor, buf: torch.Tensor, slot: int) -> None:
    """buf[slot, :n] = x + r, written in place: the fused trunk's stream without a temporary."""
    TAP_CALLS[0] += 1
    torch.add(x, r, out=buf[slot, : x.shape[0]])


@tap_sum.register_fake
def _tap_sum_fake(x, r, buf, slot):
    return None


def find_layers(model: nn.Module, n_layers: int) -> nn.ModuleList:
    """The decoder layer list: the ModuleList holding exactly n_layers blocks.

    Searching by length instead of by attribute path keeps one code path for `model.layers`
    (Llama, Qwen), `transformer.h` (GPT-2) and whatever wrapper vLLM or transformers adds.
    """
    for name in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        mod = model
        try:
            for part in name.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers:
            return mod
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers:
            return mod
    raise RuntimeError(f"could not find a list of {n_layers} decoder layers in {type(model).__name__}")


def is_fused(layer: nn.Module) -> bool:
    return "residual" in inspect.signature(layer.forward).parameters


def sublayer(layer: nn.Module, point: str) -> nn.Module | None:
    names = {"attn_out": ("self_attn", "attn", "attention"), "mlp_out": ("mlp", "feed_forward")}[point]
    for n in names:
        if isinstance(getattr(layer, n, None), nn.Module):
            return getattr(layer, n)
    return None


@dataclass
class TapSet:
    """Buffers of one engine. `reads[i]` is written into `buf[i]`; `steer[a]` is added at a."""

    reads: tuple[Address, ...]
    writes: tuple[Address, ...]
    buf: torch.Tensor | None  # [n_reads, max_tokens, width]
    steer: dict[Address, torch.Tensor] = field(default_factory=dict)  # [width] each, zero = off
    width: int = 0

    def slot(self, a: Address) -> int:
        return self.reads.index(a)


def allocate(fs: FreezeSet, max_tokens: int, width: int, dtype, device) -> TapSet:
    buf = None
    if fs.reads:
        buf = torch.zeros(len(fs.reads), max_tokens, width, dtype=dtype, device=device)
    steer = {a: torch.zeros(width, dtype=dtype, device=device) for a in fs.writes}
    return TapSet(fs.reads, fs.writes, buf, steer, width)


def check_supported(layers: nn.ModuleList, points) -> None:
    for a in points:
        if a.name == "resid_streams":
            raise ValueError(
                f"{a}: this trunk has a single residual stream; use resid_post instead"
            )
        if a.name in ("attn_out", "mlp_out") and sublayer(layers[a.layer], a.name) is None:
            raise ValueError(f"{a}: this trunk exposes no {a.name} submodule")


def install_freeze(layers: nn.ModuleList, taps: TapSet) -> None:
    """Wrap each tapped layer's forward (before vLLM compiles the model) with graph-traceable taps.

    Instance-level `forward` replacement, not hooks: dynamo inlines it into the compiled graph.
    """
    check_supported(layers, set(taps.reads) | set(taps.writes))
    by_layer: dict[int, set[str]] = {}
    for a in set(taps.reads) | set(taps.writes):
        by_layer.setdefault(a.layer, set()).add(a.name)
    for li, names in by_layer.items():
        layer = layers[li]
        for sub in ("attn_out", "mlp_out"):
            if sub in names:
                _wrap_sublayer(sublayer(layer, sub), Address(sub, li), taps)
        if names & {"resid_pre", "resid_post"}:
            _wrap_block(layer, li, taps, names)


def _reader(taps: TapSet, a: Address):
    """A closure over plain values (tensor + int slot): dynamo traces ints and tensors, while a
    frozen dataclass lookup inside the traced forward fails to reconstruct."""
    if a not in taps.reads:
        return None
    buf, slot = taps.buf, taps.slot(a)

    def read(x: torch.Tensor, r: torch.Tensor | None = None) -> None:
        if r is None:
            torch.ops.harvest.tap(x, buf, slot)
        else:
            torch.ops.harvest.tap_sum(x, r, buf, slot)

    return read


def _wrap_sublayer(mod: nn.Module, a: Address, taps: TapSet) -> None:
    orig = mod.forward
    vec = taps.steer.get(a)
    read = _reader(taps, a)

    def forward(*args, **kwargs):
        out = orig(*args, **kwargs)
        t = out[0] if isinstance(out, tuple) else out
        if vec is not None:
            t = t + vec
            out = (t,) + tuple(out[1:]) if isinstance(out, tuple) else t
        if read is not None:
            read(t)
        return out

    mod.forward = forward


def _wrap_block(layer: nn.Module, li: int, taps: TapSet, names: set[str]) -> None:
    orig = layer.forward
    pre, post = Address("resid_pre", li), Address("resid_post", li)
    pre_vec, post_vec = taps.steer.get(pre), taps.steer.get(post)
    read_pre, read_post = _reader(taps, pre), _reader(taps, post)
    if is_fused(layer):

        def forward(positions, hidden_states, residual):
            if pre_vec is not None:
                hidden_states = hidden_states + pre_vec
            if read_pre is not None:
                read_pre(hidden_states, residual)
            hidden, res = orig(positions, hidden_states, residual)
            if post_vec is not None:
                # Adding to `hidden` shifts the stream: the next fused norm adds `res` to it.
                hidden = hidden + post_vec
            if read_post is not None:
                read_post(hidden, res)
            return hidden, res

    else:

        def forward(hidden_states, *args, **kwargs):
            if pre_vec is not None:
                hidden_states = hidden_states + pre_vec
            if read_pre is not None:
                read_pre(hidden_states)
            out = orig(hidden_states, *args, **kwargs)
            t = out[0] if isinstance(out, tuple) else out
            if post_vec is not None:
                t = t + post_vec
                out = (t,) + tuple(out[1:]) if isinstance(out, tuple) else t
            if read_post is not None:
                read_post(t)
            return out

    layer.forward = forward


def install_hooks(layers: nn.ModuleList, taps: TapSet) -> list:
    """Hooked mode: the same buffers, filled by Python forward hooks (eager execution only).

    Returns the hook handles so a capture call can remove them and the next call can hook other
    points: hooked mode serves any point, freeze mode only the set it froze.
    """
    check_supported(layers, taps.reads)
    handles = []
    for a in taps.reads:
        layer = layers[a.layer]
        slot = taps.slot(a)
        if a.name in ("attn_out", "mlp_out"):
            def hook(mod, args, out, slot=slot):
                t = out[0] if isinstance(out, tuple) else out
                taps.buf[slot, : t.shape[0]].copy_(t.reshape(t.shape[0], -1))
            handles.append(sublayer(layer, a.name).register_forward_hook(hook))
        elif a.name == "resid_post":
            def hook(mod, args, out, slot=slot):
                if isinstance(out, tuple) and is_fused(mod):
                    torch.add(out[0], out[1], out=taps.buf[slot, : out[0].shape[0]])
                else:
                    t = out[0] if isinstance(out, tuple) else out
                    taps.buf[slot, : t.shape[0]].copy_(t.reshape(t.shape[0], -1))
            handles.append(layer.register_forward_hook(hook))
        else:  # resid_pre
            def hook(mod, args, kwargs, slot=slot):
                allargs = list(args) + [kwargs.get(k) for k in ("positions", "hidden_states", "residual") if k in kwargs]
                if is_fused(mod):
                    hidden, residual = allargs[1], allargs[2] if len(allargs) > 2 else None
                    if residual is None:
                        taps.buf[slot, : hidden.shape[0]].copy_(hidden)
                    else:
                        torch.add(hidden, residual, out=taps.buf[slot, : hidden.shape[0]])
                else:
                    hidden = allargs[0]
                    taps.buf[slot, : hidden.shape[0]].copy_(hidden.reshape(hidden.shape[0], -1))
            handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    return handles
