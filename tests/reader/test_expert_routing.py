"""Expert routing from router logits (store/read/routing.py) against Hugging Face's own routers:
each family's router module (random weights, and a random score-correction bias where the family
has one) on random hidden states gives (logits, weights, indices); the rule applied to those same
logits must choose the same experts (as sets per token) with the same weights."""

from __future__ import annotations

import pytest
import torch

from harvest.store.read.routing import expert_routing

E, H, N = 16, 32, 200


def _router(family: str):
    import transformers as tf

    torch.manual_seed(0)
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as R

        cfg = tf.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)
    elif family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R

        cfg = tf.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=4,
                                norm_topk_prob=True)
    elif family == "qwen3_moe_raw":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as R

        cfg = tf.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=4,
                                norm_topk_prob=False)
    elif family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as R

        cfg = tf.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=4,
                                  n_group=4, topk_group=2, norm_topk_prob=True,
                                  routed_scaling_factor=2.5)
    else:
        raise ValueError(family)
    r = R(cfg).float().eval()
    with torch.no_grad():
        for p in r.parameters():
            p.normal_(0, 0.5)
        bias = getattr(r, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.3)
    return r, cfg.to_dict(), bias


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_raw", "deepseek_v3"])
def test_routing_from_logits_equals_the_families_router(family):
    r, conf, bias = _router(family)
    x = torch.randn(N, H)
    with torch.no_grad():
        logits, weights, indices = r(x)
    idx, w = expert_routing(logits, conf, bias=bias)
    assert idx.shape == indices.shape == (N, conf["num_experts_per_tok"])
    for t in range(N):
        assert set(idx[t].tolist()) == set(indices[t].tolist()), (family, t)
        ref = dict(zip(indices[t].tolist(), weights[t].float().tolist()))
        for e, v in zip(idx[t].tolist(), w[t].tolist()):
            assert abs(ref[e] - v) < 1e-6, (family, t, e)
    assert (w[:, :-1] >= w[:, 1:]).all()   # ordered by weight


def test_the_rule_matters():
    """Taking the wrong family's rule changes the choice (the test above cannot pass by luck)."""
    r, conf, bias = _router("deepseek_v3")
    with torch.no_grad():
        logits, _, indices = r(torch.randn(N, H))
    wrong, _ = expert_routing(logits, {**conf, "model_type": "qwen3_moe"})
    assert sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(wrong, indices)) > N // 10
    unbiased, _ = expert_routing(logits, conf)   # the bias omitted
    assert sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(unbiased, indices)) > 0
