"""Attention patterns rebuilt from a store's `q` and `k`, never stored.

A pattern is heads x n x n per context per layer: for an 8B model's 32 heads over a 2,048-token
context, 512 MiB in float32 per layer, 16 GiB per context over 32 layers, against 2 x 8 MiB of
q and k in bf16 (q 4,096 wide, k 1,024 under GQA). So harvest stores q and k (after the rotary
embedding, and after QK-norm where the family has one: the vectors the kernel multiplies) and
this module recomputes the softmax the model ran, following what the model's config says:

- scale: `head_dim ** -0.5`, or `query_pre_attn_scalar ** -0.5` (Gemma 2/3), or
  `attention_multiplier` (Granite);
- GQA: query head h reads key head h // (n_heads / n_kv_heads);
- causal mask by position within the context; a sliding window where the layer has one
  (`layer_types[layer] == "sliding_attention"`, or a model-wide `sliding_window` as Mistral's;
  Qwen2's only with `use_sliding_window`): token i sees j when i - W < j <= i;
- logit soft-capping (`attn_logit_softcapping`: cap * tanh(s / cap)) before the mask;
- attention sinks (a learned logit per head that takes part in the softmax and is dropped:
  gpt-oss): pass the layer's `sinks` weights, which are weights, not config.

Exact against Hugging Face's eager attention weights (`output_attentions=True`) in float32
(tests/reader/test_attention_patterns.py). Cost measured at the 8B shape: benchmarks/results/
RESULTS.md, "Attention patterns from q and k".
"""

from __future__ import annotations

import math

import numpy as np
import torch


def layer_scale(config: dict, head_dim: int) -> float:
    if config.get("query_pre_attn_scalar"):
        return float(config["query_pre_attn_scalar"]) ** -0.5
    if config.get("attention_multiplier"):
        return float(config["attention_multiplier"])
    return head_dim ** -0.5


def layer_window(config: dict, layer: int) -> "int | None":
    """The layer's sliding window (None: full causal attention)."""
    w = config.get("sliding_window")
    types = config.get("layer_types")
    if types:
        return w if types[layer] == "sliding_attention" else None
    if config.get("model_type") in ("qwen2", "qwen2_moe") and not config.get("use_sliding_window"):
        return None
    return w


def heads_of(config: dict) -> "tuple[int, int, int]":
    """(n_heads, n_kv_heads, head_dim) from a Hugging Face config dict."""
    n = int(config.get("num_attention_heads") or config["n_head"])
    kv = int(config.get("num_key_value_heads") or n)
    hd = int(config.get("head_dim") or (config.get("hidden_size") or config["n_embd"]) // n)
    return n, kv, hd


def attention_pattern(q, k, config: dict, layer: int, *, positions=None, sinks=None,
                      heads=None) -> torch.Tensor:
    """Attention probabilities `[len(heads), n, n]` (float32) of one context at `layer`.

    `q`: `[n, n_heads * head_dim]` and `k`: `[n, n_kv_heads * head_dim]` as a store holds them
    (points `q.L` and `k.L`, heads concatenated in the model's order), any float dtype, numpy or
    torch. `positions`: each row's position in the context (default 0..n-1; rows of a packed
    context that start mid-document keep their context positions). `sinks`: the layer's sink
    logits `[n_heads]` for models that have them. `heads`: a subset of query heads (default all:
    memory is heads x n x n x 4 bytes). Row i over columns j sums to 1 (without a sink)."""
    n_heads, n_kv, hd = heads_of(config)
    q = torch.as_tensor(np.asarray(q, np.float32) if not torch.is_tensor(q) else q).float()
    k = torch.as_tensor(np.asarray(k, np.float32) if not torch.is_tensor(k) else k).float()
    n = q.shape[0]
    if q.shape != (n, n_heads * hd) or k.shape != (n, n_kv * hd):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} are not [n, {n_heads} x "
                         f"{hd}] and [n, {n_kv} x {hd}] as the config says (n_heads, "
                         "num_key_value_heads, head_dim)")
    hs = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    group = n_heads // n_kv
    qh = q.view(n, n_heads, hd)[:, hs].transpose(0, 1)                    # [H, n, hd]
    kh = k.view(n, n_kv, hd)[:, [h // group for h in hs]].transpose(0, 1)  # [H, n, hd]
    s = torch.matmul(qh, kh.transpose(1, 2)) * layer_scale(config, hd)     # [H, n, n]
    cap = config.get("attn_logit_softcapping")
    if cap:
        s = torch.tanh(s / cap) * cap
    pos = torch.arange(n) if positions is None else torch.as_tensor(np.asarray(positions)).long()
    d = pos[:, None] - pos[None, :]
    allowed = d >= 0
    w = layer_window(config, layer)
    if w:
        allowed &= d < int(w)
    s = s.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        sink = torch.as_tensor(sinks).float()[hs].view(-1, 1, 1).expand(-1, n, 1)
        both = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)
        return both[..., :n].contiguous()
    return torch.softmax(s, dim=-1)


def context_pattern(store, context: int, layer: int, config: dict, **kw) -> torch.Tensor:
    """The pattern of context `context` (its rows [context x C, (context + 1) x C) of a store
    captured with `q.{layer}` and `k.{layer}`; C: the store's context size), from the store's
    committed, checked rows. `config`: the model's Hugging Face config as a dict (for example
    `AutoConfig.from_pretrained(store.attrs["model_path"]).to_dict()`)."""
    C = int(store.context_size)
    a, b = context * C, (context + 1) * C
    q = store.read_values(f"q.{layer}", a, b)
    k = store.read_values(f"k.{layer}", a, b)
    return attention_pattern(q, k, config, layer, **kw)


__all__ = ["attention_pattern", "context_pattern", "layer_scale", "layer_window", "heads_of"]
