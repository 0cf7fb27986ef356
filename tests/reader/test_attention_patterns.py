"""Attention patterns rebuilt from q and k (store/read/attention.py) against Hugging Face's own
eager attention weights (`output_attentions=True`), in float32, on tiny random-weight trunks of
the families whose configs exercise each rule: Llama (MHA-shaped GQA, plain scale), Qwen3 (GQA,
QK-norm before the rotary embedding), Gemma 2 (soft-capping, `query_pre_attn_scalar`, sliding
windows on alternate layers), Mistral with a sliding window on every layer, and a sink logit
per head. q and k are read where the model computes them: the outputs of the family's
`apply_rotary_pos_emb`, recorded by wrapping it (as a store's q/k points are the vectors the
kernel multiplies), flattened to `[n, heads x head_dim]` as a store holds them."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from harvest.store.read.attention import attention_pattern

pytestmark = pytest.mark.slow   # builds tiny checkpoints and runs Hugging Face models


def _model(arch: str, tmp_path, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    from harvest.engine.models import build_tiny_model, cache_dir

    path = build_tiny_model(cache_dir() / "models" / f"tiny-{arch}", arch)
    cfg = AutoConfig.from_pretrained(path)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    m = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    return m, cfg


def _capture(m, arch: str, ids):
    """(HF's attention weights per layer [heads, n, n], post-RoPE q and k per layer as a store
    holds them)."""
    mod = importlib.import_module(type(m).__module__)
    real = mod.apply_rotary_pos_emb
    qs, ks = [], []

    def recording(q, k, *a, **kw):
        q2, k2 = real(q, k, *a, **kw)
        n = q2.shape[2]
        qs.append(q2[0].transpose(0, 1).reshape(n, -1))
        ks.append(k2[0].transpose(0, 1).reshape(n, -1))
        return q2, k2

    mod.apply_rotary_pos_emb = recording
    try:
        with torch.inference_mode():
            out = m(torch.tensor([ids]), output_attentions=True)
    finally:
        mod.apply_rotary_pos_emb = real
    return [a[0] for a in out.attentions], qs, ks


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),
    ("qwen3", {}),
    ("gemma2", {}),
    ("mistral", {"sliding_window": 8}),
])
def test_patterns_from_q_and_k_equal_hf_eager_attention(arch, overrides, tmp_path):
    m, cfg = _model(arch, tmp_path, **overrides)
    ids = np.random.default_rng(3).integers(3, 500, 40).tolist()
    ref, qs, ks = _capture(m, arch, ids)
    conf = cfg.to_dict()
    for L in range(cfg.num_hidden_layers):
        got = attention_pattern(qs[L].numpy(), ks[L].numpy(), conf, L)
        assert got.shape == ref[L].shape
        err = float((got - ref[L]).abs().max())
        assert err < 1e-5, (arch, L, err)
    if arch == "gemma2":   # the rules really bit: a window and a cap changed the pattern
        no_window = attention_pattern(qs[0].numpy(), ks[0].numpy(),
                                      {**conf, "layer_types": None, "sliding_window": None}, 0)
        assert float((no_window - ref[0]).abs().max()) > 1e-3
        no_cap = attention_pattern(qs[1].numpy(), ks[1].numpy(),
                                   {**conf, "attn_logit_softcapping": None}, 1)
        assert float((no_cap - ref[1]).abs().max()) > 1e-6


def test_bf16_rows_as_a_store_holds_them_stay_close():
    """q and k stored in bf16 (a store's dtype) give the fp32 pattern to within bf16's rounding."""
    rng = np.random.default_rng(0)
    conf = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    q, k = rng.standard_normal((30, 64)).astype(np.float32), rng.standard_normal((30, 32)).astype(np.float32)
    exact = attention_pattern(q, k, conf, 0)
    rounded = attention_pattern(torch.tensor(q).bfloat16(), torch.tensor(k).bfloat16(), conf, 0)
    assert float((exact - rounded).abs().max()) < 2e-2
    assert torch.allclose(exact.sum(-1), torch.ones(4, 30), atol=1e-5)


def test_sinks_take_part_in_the_softmax_and_are_dropped():
    rng = np.random.default_rng(1)
    conf = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    q, k = rng.standard_normal((5, 16)), rng.standard_normal((5, 8))
    sinks = torch.tensor([0.5, 3.0])
    got = attention_pattern(q, k, conf, 0, sinks=sinks)
    s = torch.tensor(q, dtype=torch.float32).view(5, 2, 8).transpose(0, 1) @ \
        torch.tensor(k, dtype=torch.float32).view(5, 1, 8).transpose(0, 1).transpose(1, 2) * 8 ** -0.5
    s = s.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.softmax(torch.cat([s, sinks.view(2, 1, 1).expand(2, 5, 1)], -1), -1)[..., :5]
    assert torch.allclose(got, ref, atol=1e-6)
    assert (got.sum(-1) < 1).all()   # the sink took its share


def test_a_shape_the_config_does_not_describe_is_refused():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        attention_pattern(np.zeros((4, 32)), np.zeros((4, 32)),
                          {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}, 0)
