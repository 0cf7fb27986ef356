"""Where each point of engine/points.py lives inside a decoder block: the candidate module sites.

A site is a module path under the block (`self_attn.o_proj`) and a reading of that module's call:
- "in": its stream argument (the first floating tensor of the point's width, by parameter name);
  with `arg`, the argument of that parameter name instead, heads flattened (`[tokens, heads,
  head_dim]` -> `[tokens, heads x head_dim]`): q, k, v are the `query`, `key`, `value` inputs of
  vLLM's attention module (`self_attn.attn`), whose model code applies the rotary embedding (and
  QK-norm) before calling it (vLLM's Transformers backend attaches its Attention there too and
  calls it from transformers' attention interface, after the Hugging Face module's own rotary);
- "in+res": its stream argument plus its `residual` argument when one is passed (vLLM's fused
  add-norm `norm(x, residual)` adds them before normalising: the sum is the stream);
- "out": its output (a tensor, `(output, bias)` of a vLLM linear, or the first of a tuple); with
  `part` = (i, k), the i-th of k equal column blocks of it: mlp_pre and mlp_pre_linear are the
  two halves `[gate | up]` of a fused `gate_up_proj` (vLLM's MergedColumnParallelLinear, whose
  output on each rank is `[gate shard | up shard]`);
- "attn_fn": the eager (Hugging Face) backend only: the `arg` input of the attention function
  the module calls through transformers' AttentionInterface (engine/hf_backend.py), which is
  where Hugging Face's q and k exist after the rotary embedding.

The names are shared by vLLM's own models and Hugging Face's (vLLM's Transformers backend runs
the HF modules), so one rule serves both; which candidate is right in a given block is measured by
the probe (engine/capture/probe.py `check_sites`) on the engine, never assumed. Points not listed in
`candidates` (resid_pre, resid_post, embeddings: the block's own stream; attn_out, mlp_out: the
sublayer outputs, engine/capture/block_stream.py) are read by the block wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .block_stream import SUBMODULE_NAMES

ATTN_NAMES = SUBMODULE_NAMES["attn_out"]
MLP_NAMES = SUBMODULE_NAMES["mlp_out"]
O_PROJ = ("o_proj", "c_proj", "dense", "out_proj", "wo")
ATTN_KERNEL = "attn"  # vLLM's Attention module inside the attention block: attn(query, key, value)
QKV_ARGS = {"q": "query", "k": "key", "v": "value"}
GATE_UP = "gate_up_proj"  # fused [gate | up] (vLLM's MergedColumnParallelLinear; HF Phi-3)
GATE_PROJ, UP_PROJ = "gate_proj", "up_proj"
# an ungated MLP's up projection (GPT-2/Starcoder2, Falcon/GPT-NeoX, GPT-J, OPT): its output is
# the pre-activation; whether the activation of it is what down_proj reads is measured
UP_ONLY = ("c_fc", "dense_h_to_4h", "fc_in", "fc1")
DOWN_PROJ = ("down_proj", "c_proj", "dense_4h_to_h", "fc_out", "fc2", "w2")
GATES = ("gate", "router")
PRE_MLP_NORMS = ("post_attention_layernorm", "ln_2")
SITE_POINTS = ("attn_in", "q", "k", "v", "z", "attn_out_post", "resid_mid", "mlp_in", "mlp_pre",
               "mlp_pre_linear", "mlp_act", "router_logits", "mlp_out_post")
READINGS = ("in", "in+res", "out", "attn_fn")


@dataclass(frozen=True)
class Site:
    """One point's module in a block: `path` under the block, `reading` of READINGS, and the
    argument slots the probe located ((index, name) of the stream and of the residual); `arg`:
    the parameter read by name (q/k/v); `part`: (i, k), the i-th of k equal column blocks of the
    output (the halves of a fused gate_up_proj)."""

    path: str
    reading: str
    stream: tuple = (None, None)
    residual: tuple | None = None
    arg: str | None = None
    part: tuple[int, int] | None = None


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


def mlp_pre_sites(mlp: nn.Module, name: str, path: str) -> tuple[dict[str, Site], dict[str, str]]:
    """mlp_pre / mlp_pre_linear of a dense MLP (`path` under the block), by the projections it
    has: a fused gate_up_proj's halves, separate gate_proj / up_proj, or an ungated up
    projection (mlp_pre only). Which half is the gate, and that the activation of it (times the
    linear branch) is down_proj's input, is measured by the probe (probe_sites.check)."""
    if child(mlp, (GATE_UP,)):
        return ({"mlp_pre": Site(f"{path}.{GATE_UP}", "out", part=(0, 2)),
                 "mlp_pre_linear": Site(f"{path}.{GATE_UP}", "out", part=(1, 2))}, {})
    if child(mlp, (GATE_PROJ,)) and child(mlp, (UP_PROJ,)):
        return ({"mlp_pre": Site(f"{path}.{GATE_PROJ}", "out"),
                 "mlp_pre_linear": Site(f"{path}.{UP_PROJ}", "out")}, {})
    up = child(mlp, UP_ONLY)
    if up is not None:
        return ({"mlp_pre": Site(f"{path}.{up}", "out")},
                {"mlp_pre_linear": f"{name} is not a gated MLP (its up projection {up} feeds the "
                                   "activation directly): there is no linear branch; capture "
                                   "mlp_pre (the pre-activation)"})
    msg = (f"{name} has none of the projections {GATE_UP}, {GATE_PROJ}/{UP_PROJ}, "
           f"{', '.join(UP_ONLY)}, so its pre-activation is never a module's output")
    return {}, {"mlp_pre": msg, "mlp_pre_linear": msg}


def candidates(layer: nn.Module) -> tuple[dict[str, Site], dict[str, str]]:
    """The candidate site of every SITE_POINTS point this block has, and for each one it has not,
    the reason (the refusal text)."""
    sites, why = {}, {}
    attn, mlp = child(layer, ATTN_NAMES), child(layer, MLP_NAMES)
    cls = type(layer).__name__
    if attn is None:
        for p in ("attn_in", "q", "k", "v", "z"):
            why[p] = f"block {cls} has none of the attention modules {', '.join(ATTN_NAMES)}"
    else:
        sites["attn_in"] = Site(attn, "in")
        if child(getattr(layer, attn), (ATTN_KERNEL,)):
            for p, arg in QKV_ARGS.items():
                sites[p] = Site(f"{attn}.{ATTN_KERNEL}", "in", arg=arg)
        else:
            for p in QKV_ARGS:
                why[p] = (f"{cls}.{attn} has no attention kernel module ({attn}.{ATTN_KERNEL}, "
                          "vLLM's Attention) whose query/key/value inputs are the post-rotary "
                          "q, k and v, so they are never a module's input")
        o = child(getattr(layer, attn), O_PROJ)
        if o is None:
            why["z"] = (f"{cls}.{attn} has none of the output projections {', '.join(O_PROJ)}, "
                        "so the heads' outputs are never a tensor of their own")
        else:
            sites["z"] = Site(f"{attn}.{o}", "in")
    moe = False
    if mlp is None:
        for p in ("mlp_in", "mlp_pre", "mlp_pre_linear", "mlp_act", "router_logits"):
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
            for p in ("mlp_pre", "mlp_pre_linear"):
                why[p] = (f"{cls}.{mlp} is a mixture of experts: the fused MoE kernel computes "
                          "every expert's gate and up projections inside one kernel, so no "
                          "module outputs them")
        else:
            pre_sites, pre_why = mlp_pre_sites(mod, f"{cls}.{mlp}", mlp)
            sites.update(pre_sites)
            why.update(pre_why)
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
