"""Block semantics: where a decoder block's residual stream goes in and where it comes out.

A tap needs three facts about each block, and the trunks vLLM runs disagree on all three:
- which argument carries the stream: `layer(positions, hidden_states, residual)` (Llama, Qwen),
  `layer(positions, hidden_states)` (Granite, StableLM, Falcon, GPT-J), `layer(hidden_states)`
  (GPT-2), `layer(hidden_states, attention_mask=..., ...)` (HF layers under vLLM's Transformers
  backend), with keyword extras such as `t_cond=None` (Mistral) that must pass through untouched;
- whether a second input is part of the stream: fused trunks carry it as `hidden + residual`
  (Llama); Cohere and EXAONE-4 take a `residual` argument and ignore it;
- how the output holds the stream: a tensor; `(hidden, residual)` whose sum is the stream (Llama);
  or `(stream, something_else)` (Cohere, EXAONE-4, StableLM);
and the layout is `[tokens, width]`, or `[1, tokens, width]` under the Transformers backend.

Two trunks with the same signature (Llama, Cohere) need opposite answers, so the answers are
measured per block by engine/capture/probe.py; `guess` (from the signature) is only the fallback a user
explicitly opts into, and the Hugging Face reference backend's rule (HF layers return the stream).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

# Parameter names that carry the stream, best first; a block whose stream argument has another
# name is still found (the first stream-shaped floating tensor of the call).
STREAM_NAMES = ("hidden_states", "hidden_state", "hidden", "x", "inputs_embeds", "input")
RESIDUAL_NAMES = ("residual", "residuals")

# Sub-module attribute names of the block whose output is `attn_out` / `mlp_out`, shared by both
# backends so a point is served (or refused) alike. MoE blocks count as the MLP (`block_sparse_moe`:
# Mixtral, PhiMoE, GraniteMoE; `mlp`: Qwen-MoE, OLMoE). A bare `experts` child is deliberately
# absent: it holds the routed experts only, before router weighting and shared experts, so its
# output is not the block's MLP output.
SUBMODULE_NAMES = {
    "attn_out": ("self_attn", "self_attention", "attn", "attention"),
    "mlp_out": ("mlp", "block_sparse_moe", "feed_forward", "ffn", "moe"),
}

POST_MODES = ("tensor", "first", "sum")


@dataclass(frozen=True)
class Slot:
    """One argument of a call: by position when the caller passes it positionally, else by name."""

    index: int | None
    name: str | None

    def get(self, args: tuple, kwargs: dict):
        return arg_value(args, kwargs, self.index, self.name)


def arg_value(args: tuple, kwargs: dict, index: int | None, name: str | None):
    """Plain function over plain values: dynamo traces it inside the compiled forward."""
    if index is not None and index < len(args):
        return args[index]
    if name is not None:
        return kwargs.get(name)
    return None


def with_arg(args: tuple, kwargs: dict, index: int | None, name: str | None, value):
    if index is not None and index < len(args):
        return args[:index] + (value,) + args[index + 1:], kwargs
    return args, {**kwargs, name: value}


@dataclass(frozen=True)
class BlockSemantics:
    """How one block carries the residual stream (see the module docstring).

    resid_pre = stream input (+ residual input when `pre_adds_residual` and it is not None);
    resid_post = output tensor ("tensor"), `out[0]` ("first") or `out[0] + out[1]` ("sum").
    `submodules` maps attn_out / mlp_out to the attribute whose output they are, for the points
    this block serves.
    """

    stream: Slot
    residual: Slot | None = None
    pre_adds_residual: bool = False
    post: str = "tensor"
    submodules: dict[str, str] = field(default_factory=dict)
    how: str = "probe"  # "probe" (measured), "guess" (signature, opted into), "hf" (reference)
    sites: dict = field(default_factory=dict)  # point -> engine/sites.Site, verified by the probe

    def __post_init__(self):
        if self.post not in POST_MODES:
            raise ValueError(f"post={self.post!r}: use one of {POST_MODES}")

    def describe(self) -> dict:
        return {"stream": self.stream.name or f"arg{self.stream.index}",
                "pre": "stream+residual" if self.pre_adds_residual else "stream",
                "post": self.post, "submodules": dict(self.submodules), "how": self.how,
                "sites": {p: f"{s.path} ({s.reading})" for p, s in self.sites.items()}}


def rows(t: torch.Tensor) -> torch.Tensor:
    """[tokens, width] or [1, tokens, width] -> [tokens, width] (a view where the layout allows)."""
    return t.reshape(-1, t.shape[-1])


def is_stream_like(v, width: int) -> bool:
    return (isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() in (2, 3)
            and v.shape[-1] == width and (v.dim() == 2 or v.shape[0] == 1))


def pre_value(sem: BlockSemantics, args: tuple, kwargs: dict) -> torch.Tensor:
    h = sem.stream.get(args, kwargs)
    r = sem.residual.get(args, kwargs) if sem.pre_adds_residual and sem.residual else None
    return h if r is None else h + r


def post_value(post: str, out) -> torch.Tensor:
    if post == "tensor":
        return out
    if post == "first":
        return out[0]
    return out[0] + out[1]


def post_candidates(out, width: int) -> list[str]:
    """The readings of a block's output that the probe tries, in order."""
    if isinstance(out, torch.Tensor):
        return ["tensor"] if is_stream_like(out, width) else []
    if isinstance(out, (tuple, list)) and out and is_stream_like(out[0], width):
        second = out[1] if len(out) > 1 else None
        if isinstance(second, torch.Tensor) and second.shape == out[0].shape:
            return ["first", "sum"]
        return ["first"]
    return []


def positional_names(fn) -> tuple[list[str], set[str]]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [], set()
    pos = [p.name for p in params
           if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return pos, {p.name for p in params}


def locate_inputs(fn, args: tuple, kwargs: dict, width: int) -> tuple[Slot | None, Slot | None]:
    """(stream slot, residual slot) of one recorded call, by parameter name and tensor shape.

    The stream is the stream-shaped floating tensor named like STREAM_NAMES (else the first
    one); positions (integer) and attention masks (wrong shape) never qualify. The residual is a
    parameter named like RESIDUAL_NAMES (None on the first layer), else another stream-shaped
    tensor of the call. Whether it is part of the stream is for the probe to measure.
    """
    pos_names, all_names = positional_names(fn)
    found: list[tuple[Slot, object]] = []
    for i, v in enumerate(args):
        found.append((Slot(i, pos_names[i] if i < len(pos_names) else None), v))
    for k, v in kwargs.items():
        found.append((Slot(pos_names.index(k) if k in pos_names else None, k), v))
    streamy = [(s, v) for s, v in found if is_stream_like(v, width)]
    if not streamy:
        return None, None
    rank = {n: i for i, n in enumerate(STREAM_NAMES)}
    stream = min(streamy, key=lambda sv: (rank.get(sv[0].name, len(rank)), streamy.index(sv)))[0]
    residual = next((s for s, _ in found if s.name in RESIDUAL_NAMES), None)
    if residual is None:
        for n in RESIDUAL_NAMES:  # not passed at all this call, but the block takes it
            if n in all_names:
                residual = Slot(pos_names.index(n) if n in pos_names else None, n)
                break
    if residual is None:
        residual = next((s for s, _ in streamy if s != stream), None)
    return stream, residual


def sublayer_name(layer: nn.Module, point: str) -> str | None:
    for n in SUBMODULE_NAMES[point]:
        if isinstance(getattr(layer, n, None), nn.Module):
            return n
    return None


def sublayer_value(out) -> torch.Tensor | None:
    """A sub-module's output: a tensor, or vLLM's `(output, bias)` with the bias not yet added
    (`skip_bias_add` linears, e.g. Falcon); other tuples give their first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        bias = out[1] if len(out) == 2 else None
        if isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.shape[0] == out[0].shape[-1]:
            return out[0] + bias
        return out[0]
    return None


def guess(layer: nn.Module) -> BlockSemantics:
    """Semantics from the signature alone: the rule before the probe existed, right for Llama-style
    fused trunks and wrong for Cohere/EXAONE-4. Used only when a user opts out of the probe."""
    pos_names, all_names = positional_names(layer.forward)
    name = next((n for n in STREAM_NAMES if n in all_names), pos_names[0] if pos_names else None)
    stream = Slot(pos_names.index(name) if name in pos_names else None, name)
    res = next((n for n in RESIDUAL_NAMES if n in all_names), None)
    residual = Slot(pos_names.index(res) if res in pos_names else None, res) if res else None
    subs = {p: n for p in SUBMODULE_NAMES if (n := sublayer_name(layer, p))}
    return BlockSemantics(stream, residual, pre_adds_residual=residual is not None,
                          post="sum" if residual is not None else "first", submodules=subs,
                          how="guess")


def hf_semantics(layer: nn.Module) -> BlockSemantics:
    """A Hugging Face decoder layer: the stream in as `hidden_states`, the stream out (a tensor;
    older layers return it first in a tuple, read with `first_or_tensor`). HF's own
    `output_hidden_states` is built from exactly these, which the eager backend's tests check."""
    pos_names, all_names = positional_names(layer.forward)
    name = next((n for n in STREAM_NAMES if n in all_names), pos_names[0] if pos_names else None)
    stream = Slot(pos_names.index(name) if name in pos_names else None, name)
    subs = {p: n for p in SUBMODULE_NAMES if (n := sublayer_name(layer, p))}
    return BlockSemantics(stream, None, post="tensor", submodules=subs, how="hf")


def first_or_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@dataclass(frozen=True)
class RoutingSite:
    """Where a MoE layer's routing choice is handed over: `getattr(obj, attr)` is called by the
    layer and returns a tuple whose items `weights_at` and `ids_at` are the top-k weights and
    expert ids `[tokens, k]` the experts are then computed with (vLLM's router `select_experts`:
    (weights, ids); a Hugging Face top-k router's forward: (logits, weights, ids)). `why`: a
    note for the capture's refusal where the layer has none."""

    obj: object
    attr: str
    weights_at: int
    ids_at: int


class Trunk:
    """The decoder layers with each block's semantics; indexes like the ModuleList it wraps, so
    code that only needs `trunk[i]` (a module) keeps working."""

    def __init__(self, layers: nn.ModuleList, semantics: "list[BlockSemantics]",
                 report: dict | None = None):
        if len(semantics) != len(layers):
            raise ValueError(f"{len(semantics)} block semantics for {len(layers)} layers")
        self.layers, self.semantics, self.report = layers, list(semantics), report or {}
        # the model's final norm, where the probe found the module whose output is the model's
        # final hidden state (final_norm.0); None: that point is refused
        self.final_norm: nn.Module | None = None
        # layer -> where its MoE router hands over its top-k choice (expert_indices/_weights),
        # set by the backend that knows its router (engine/vllm/compat.moe_routers, the eager
        # backend's Hugging Face gates); a layer not in it serves no routing point
        self.routing: dict[int, "RoutingSite"] = {}

    def __getitem__(self, i: int) -> nn.Module:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def sublayer(self, point) -> nn.Module | None:
        """The module whose output is `point` (an Address of attn_out/mlp_out), or None."""
        name = self.semantics[point.layer].submodules.get(point.name)
        return getattr(self.layers[point.layer], name) if name else None
