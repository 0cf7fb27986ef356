"""Where each point of engine/points.py lives inside a decoder block: the candidate module sites.

A site is a module path under the block (`self_attn.o_proj`) and a reading of that module's call:
- "in": its stream argument (the first floating tensor of the point's width, by parameter name);
- "in+res": its stream argument plus its `residual` argument when one is passed (vLLM's fused
  add-norm `norm(x, residual)` adds them before normalising: the sum is the stream);
- "out": its output (a tensor, `(output, bias)` of a vLLM linear, or the first of a tuple).

The names are shared by vLLM's own models and Hugging Face's (vLLM's Transformers backend runs
the HF modules), so one rule serves both; which candidate is right in a given block is measured by
the probe (engine/capture/probe.py `check_sites`) on the engine, never assumed. Points not listed in
`candidates` (resid_pre, resid_post, embeddings: the block's own stream; attn_out, mlp_out: the
sublayer outputs, engine/capture/blocks.py) are read by the block wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .blocks import SUBMODULE_NAMES

ATTN_NAMES = SUBMODULE_NAMES["attn_out"]
MLP_NAMES = SUBMODULE_NAMES["mlp_out"]
O_PROJ = ("o_proj", "c_proj", "dense", "out_proj", "wo")
DOWN_PROJ = ("down_proj", "c_proj", "dense_4h_to_h", "fc_out", "fc2", "w2")
GATES = ("gate", "router")
PRE_MLP_NORMS = ("post_attention_layernorm", "ln_2")
SITE_POINTS = ("attn_in", "z", "attn_out_post", "resid_mid", "mlp_in", "mlp_act",
               "router_logits", "mlp_out_post")
READINGS = ("in", "in+res", "out")


@dataclass(frozen=True)
class Site:
    """One point's module in a block: `path` under the block, `reading` of READINGS, and the
    argument slots the probe located ((index, name) of the stream and of the residual)."""

    path: str
    reading: str
    stream: tuple = (None, None)
    residual: tuple | None = None


def child(mod: nn.Module, names) -> str | None:
    for n in names:
        if isinstance(getattr(mod, n, None), nn.Module):
            return n
    return None


def module_at(layer: nn.Module, path: str) -> nn.Module:
    mod = layer
    for part in path.split("."):
        mod = getattr(mod, part)
    return mod


def is_moe(mlp: nn.Module) -> bool:
    return child(mlp, GATES) is not None and child(mlp, ("experts",)) is not None


def layout_of(layer: nn.Module) -> str:
    """`sandwich` where the block norms the MLP output (post_feedforward_layernorm), else
    `sequential`; whether a block is really `parallel` is measured by the probe (resid_mid)."""
    return "sandwich" if child(layer, ("post_feedforward_layernorm",)) else "sequential"


def candidates(layer: nn.Module) -> tuple[dict[str, Site], dict[str, str]]:
    """The candidate site of every SITE_POINTS point this block has, and for each one it has not,
    the reason (the refusal text)."""
    sites, why = {}, {}
    attn, mlp = child(layer, ATTN_NAMES), child(layer, MLP_NAMES)
    cls = type(layer).__name__
    if attn is None:
        for p in ("attn_in", "z"):
            why[p] = f"block {cls} has none of the attention modules {', '.join(ATTN_NAMES)}"
    else:
        sites["attn_in"] = Site(attn, "in")
        o = child(getattr(layer, attn), O_PROJ)
        if o is None:
            why["z"] = (f"{cls}.{attn} has none of the output projections {', '.join(O_PROJ)}, "
                        "so the heads' outputs are never a tensor of their own")
        else:
            sites["z"] = Site(f"{attn}.{o}", "in")
    moe = False
    if mlp is None:
        for p in ("mlp_in", "mlp_act", "router_logits"):
            why[p] = f"block {cls} has none of the MLP modules {', '.join(MLP_NAMES)}"
    else:
        sites["mlp_in"] = Site(mlp, "in")
        mod = getattr(layer, mlp)
        moe = is_moe(mod)
        if moe:
            why["mlp_act"] = (f"{cls}.{mlp} is a mixture of experts: the fused MoE kernel "
                              "computes every expert's hidden activations inside one kernel, "
                              "so there is no down_proj input to read")
            sites["router_logits"] = Site(f"{mlp}.{child(mod, GATES)}", "out")
        else:
            why["router_logits"] = f"block {cls} has a dense MLP ({mlp}): no router"
            d = child(mod, DOWN_PROJ)
            if d is None:
                why["mlp_act"] = (f"{cls}.{mlp} has none of {', '.join(DOWN_PROJ)}, so its "
                                  "hidden activations are never a module's input")
            else:
                sites["mlp_act"] = Site(f"{mlp}.{d}", "in")
    if layout_of(layer) == "sandwich":
        sites["mlp_out_post"] = Site("post_feedforward_layernorm", "out")
        if child(layer, ("post_attention_layernorm",)):
            sites["attn_out_post"] = Site("post_attention_layernorm", "out")
        else:
            why["attn_out_post"] = f"block {cls} has no post_attention_layernorm"
        pre = child(layer, ("pre_feedforward_layernorm",))
        if pre:
            sites["resid_mid"] = Site(pre, "in+res")
        elif mlp is not None:  # post-norm only (OLMo 2): the MLP reads the stream itself
            sites["resid_mid"] = Site(mlp, "in")
    else:
        for p in ("attn_out_post", "mlp_out_post"):
            why[p] = (f"block {cls} has no sublayer post-norms (post_feedforward_layernorm): "
                      f"{p} would be the same tensor as {p[:-5]}; capture {p[:-5]}")
        pre = child(layer, PRE_MLP_NORMS)
        if pre:
            sites["resid_mid"] = Site(pre, "in+res")
    if "resid_mid" not in sites:
        why["resid_mid"] = (f"block {cls} has no norm between attention and the MLP: a parallel "
                            "block (attention and MLP both read resid_pre) has no stream between "
                            "them; capture resid_pre and attn_out")
    return sites, why
