"""Expert routing of MoE layers, from a store's `router_logits`: which experts each token went to.

A store captured with `router_logits.L` (docs/engine.md's points: one logit per expert, off the
replicated gate, the values vLLM's fused MoE kernel routes from) holds everything the routing
rule needs; the rule is the model's, read from its config:

- softmax, top-k, and renormalised over the k when the model does (`norm_topk_prob`; Mixtral
  always): Mixtral, Qwen2/3-MoE, OLMoE;
- top-k of the logits, then a softmax over those k: gpt-oss;
- sigmoid scores, a bias added for the choice only (`e_score_correction_bias`, a weight: pass
  it), groups ranked by the sum of their two best scores with only the best `topk_group` of
  `n_group` groups eligible, top-k, weights the unbiased scores renormalised
  (`norm_topk_prob`) and scaled (`routed_scaling_factor`): DeepSeek-V3, GLM-4.5 (MoE).

`expert_routing` returns `(indices [n, k] int64, weights [n, k] float32)`, experts ordered by
weight. Checked against Hugging Face's own routers on the same logits, as sets per token and
weights to 1e-6 (tests/reader/test_expert_routing.py).

A store captured with `expert_indices.L` / `expert_weights.L` holds the routing itself, as the
engine read it where vLLM hands the router's choice to its fused kernel (docs/engine.md's
points; FORMAT.md "Points of 32-bit values"): `stored_routing` reads it back. Both ways are held
to Hugging Face's router (tests/engine/test_points_routing.py for the engine's, the test above for
this rule), so they agree.
"""

from __future__ import annotations

import numpy as np
import torch

SIGMOID_GROUPED = ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite", "kimi_k2")
TOPK_THEN_SOFTMAX = ("gpt_oss",)
ALWAYS_RENORMALISED = ("mixtral",)


def top_k(config: dict) -> int:
    k = config.get("num_experts_per_tok") or config.get("num_experts_per_token")
    if not k:
        raise ValueError("the config names no num_experts_per_tok: not a MoE model's config")
    return int(k)


def expert_routing(router_logits, config: dict, *, bias=None) -> "tuple[torch.Tensor, torch.Tensor]":
    """(expert indices, routing weights) `[n, k]` for router logits `[n, n_experts]` (numpy or
    torch, any float dtype) by the rule of `config` (a Hugging Face config as a dict; see the
    module docstring). `bias`: the layer's `e_score_correction_bias` for sigmoid-grouped
    routers."""
    x = router_logits if torch.is_tensor(router_logits) else torch.as_tensor(
        np.asarray(router_logits, np.float32))
    x = x.float()
    k = top_k(config)
    mt = config.get("model_type", "")
    if mt in SIGMOID_GROUPED:
        w, idx = _sigmoid_grouped(x, config, k, bias)
    elif mt in TOPK_THEN_SOFTMAX:
        vals, idx = torch.topk(x, k, dim=-1)
        w = torch.softmax(vals, dim=-1)
    else:
        probs = torch.softmax(x, dim=-1)
        w, idx = torch.topk(probs, k, dim=-1)
        if mt in ALWAYS_RENORMALISED or config.get("norm_topk_prob"):
            w = w / w.sum(dim=-1, keepdim=True)
    order = torch.argsort(w, dim=-1, descending=True)
    return idx.gather(-1, order).long(), w.gather(-1, order).float()


def _sigmoid_grouped(x, config: dict, k: int, bias):
    n, e = x.shape
    scores = x.sigmoid()
    choice = scores + (torch.as_tensor(bias).float() if bias is not None else 0.0)
    n_group = int(config.get("n_group") or 1)
    topk_group = int(config.get("topk_group") or n_group)
    if e % n_group:
        raise ValueError(f"{e} experts do not split into n_group={n_group} groups")
    group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
    choice = choice.masked_fill(~mask.bool(), 0.0)
    idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if config.get("norm_topk_prob"):
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * float(config.get("routed_scaling_factor") or 1.0), idx


def stored_routing(store, layer: int, start: int, stop: int):
    """(indices int64 `[n, k]` or None, weights float32 `[n, k]` or None) of rows [start, stop)
    at MoE layer `layer`, as the capture stored them (`expert_indices.L`, `expert_weights.L`,
    experts ordered by weight); a ValueError naming the way out when the store has neither."""
    ip, wp = f"expert_indices.{layer}", f"expert_weights.{layer}"
    have = store.point_values
    if ip not in have and wp not in have:
        raise ValueError(f"the store holds neither {ip} nor {wp}: capture them, or route its "
                         f"router_logits.{layer} with expert_routing(logits, model config)")
    ids = torch.from_numpy(store.read_values(ip, start, stop).astype(np.int64)) if ip in have else None
    w = torch.from_numpy(np.array(store.read_values(wp, start, stop), np.float32)) if wp in have else None
    return ids, w


__all__ = ["expert_routing", "stored_routing", "top_k"]
