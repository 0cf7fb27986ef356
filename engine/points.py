"""The table of capture points, as data: what each point is, how wide it is, where it lives.

Every consumer reads this one table: the address grammar (engine/addresses.py), the taps and the
probe (engine/capture/sites.py: where a point's tensor is inside a block), config checks
(pipeline/config/sections.py), the store and `harvest plan` (widths), and docs/engine.md's point table.

Width kinds: `d_model` (the stream), `heads` (n_heads x head_dim: o_proj's input, the query),
`kv_heads` (n_kv_heads x head_dim: the key and value, KV heads as they are under grouped-query
attention), `neurons` (the MLP width: down_proj's input, each of the gate and up projections),
`experts` (one router logit per expert), `topk` (one value per routed expert of a token:
`num_experts_per_tok`), `scalar` (one float32 per row: the model's own next-token
scores, computed from its final logits after the forward, engine/capture/scores.py). Under tensor parallelism `heads`, `kv_heads` and
`neurons` are column-sharded across ranks (a rank holds a slice; with fewer KV heads than ranks
vLLM gives each rank one KV head, the same on `tp / n_kv_heads` ranks: `shard_width`,
`kv_replicas`); `experts` and `topk` come off a replicated gate and router, `d_model` points are
all-reduced.

Values of their own type: a point whose `values` is set ("float32", "int32": logprob, entropy,
expert_weights, expert_indices) holds numbers that are not activations in the engine dtype; they
travel bit for bit through the tap buffer and every transport, each value in `values_per_slot`
elements of the engine dtype (two bfloat16 columns per 32-bit value: engine/capture/packed.py),
and a capture hands them back in their own type (`CapturedRequest.point`).

Block layouts (measured per block by the probe; see engine/capture/sites.py):
- `sequential`: pre-norm blocks, attention then MLP on the updated stream (Llama, GPT-2, Qwen);
- `sandwich`: sequential plus norms on the sublayer outputs (Gemma 2/3: pre and post norms;
  OLMo 2: post norms only);
- `parallel`: attention and MLP both read the block's input stream (GPT-NeoX, GPT-J, Falcon,
  Cohere): there is no stream between them, so no `resid_mid` and no sublayer post-norms.
"""

from __future__ import annotations

from dataclasses import dataclass

WIDTH_KINDS = ("d_model", "heads", "kv_heads", "neurons", "experts", "topk", "scalar")
VALUE_TYPES = ("float32", "int32")
LAYOUTS = ("sequential", "sandwich", "parallel")


@dataclass(frozen=True)
class Point:
    """One row of the table.

    `layouts`: the block layouts that have the point (a block of another layout refuses it by
    name); `moe`: True = MoE blocks only, False = dense MLPs only, None = both; `level`: "layer"
    (one per block, `name.L`) or "model" (one per model, addressed `name.0`); `tp`: "replicated"
    (every rank holds the whole row) or "sharded" (each rank a column slice); `gated`: True =
    gated MLPs only (a gate and an up projection whose product the down projection reads);
    `logits`: True = computed from the model's final logits after the forward (no tap site);
    `values`: the type of the point's numbers where they are not activations in the engine dtype
    ("float32", "int32"; packed bit for bit in the engine dtype's elements, see the module
    docstring); `routing`: True = read from the MoE router's top-k choice (the experts and
    weights the fused kernel used), not from a module site.
    """

    name: str
    width: str
    tp: str
    layouts: tuple[str, ...]
    meaning: str
    level: str = "layer"
    moe: bool | None = None
    gated: bool = False
    logits: bool = False
    values: str | None = None
    routing: bool = False

    def __post_init__(self):
        assert self.width in WIDTH_KINDS and self.tp in ("replicated", "sharded")
        assert self.values in (None, *VALUE_TYPES)
        assert set(self.layouts) <= set(LAYOUTS) and self.level in ("layer", "model")


_ALL = LAYOUTS
_SEQ = ("sequential", "sandwich")
TABLE: tuple[Point, ...] = (
    Point("embeddings", "d_model", "replicated", _ALL,
          "the token embeddings as the model scales them: the stream entering block 0",
          level="model"),
    Point("resid_pre", "d_model", "replicated", _ALL, "the stream entering block L"),
    Point("attn_in", "d_model", "replicated", _ALL,
          "attention's normalised input (input_layernorm / ln_1 output)"),
    Point("q", "heads", "sharded", _ALL,
          "attention's queries, heads concatenated in the model's order, after the rotary "
          "embedding (and QK-norm where the family has one): the attention kernel's query input"),
    Point("k", "kv_heads", "sharded", _ALL,
          "attention's keys (KV heads as under grouped-query attention), after the rotary "
          "embedding (and QK-norm): the attention kernel's key input"),
    Point("v", "kv_heads", "sharded", _ALL,
          "attention's values (KV heads as under grouped-query attention): the value "
          "projection's output, the attention kernel's value input"),
    Point("z", "heads", "sharded", _ALL,
          "the per-head attention outputs before the output projection (o_proj's input)"),
    Point("attn_out", "d_model", "replicated", _ALL,
          "the attention sublayer's output, before any post-norm and the residual add"),
    Point("attn_out_post", "d_model", "replicated", ("sandwich",),
          "the attention output after its post-norm (post_attention_layernorm output)"),
    Point("resid_mid", "d_model", "replicated", _SEQ,
          "the stream between attention and MLP (after attention's residual add)"),
    Point("mlp_in", "d_model", "replicated", _ALL,
          "the MLP's input (post_attention_layernorm / pre_feedforward_layernorm / ln_2 output)"),
    Point("mlp_pre", "neurons", "sharded", _ALL,
          "the MLP's pre-activation: the gate projection's output (gated MLPs; the first half "
          "of a fused gate_up_proj), else the up projection's (c_fc); TransformerLens hook_pre",
          moe=False),
    Point("mlp_pre_linear", "neurons", "sharded", _ALL,
          "the gated MLP's linear branch: the up projection's output (the second half of a "
          "fused gate_up_proj); TransformerLens hook_pre_linear", moe=False, gated=True),
    Point("mlp_act", "neurons", "sharded", _ALL,
          "the MLP's hidden activations (down_proj's input)", moe=False),
    Point("router_logits", "experts", "replicated", _ALL,
          "the MoE gate's logits, one per expert, before softmax and top-k", moe=True),
    Point("expert_indices", "topk", "replicated", _ALL,
          "int32: the experts the MoE router chose for the token, k = num_experts_per_tok, "
          "ordered by weight (largest first): the ids vLLM's fused kernel used, by the model's own "
          "rule (softmax or sigmoid, bias correction, grouped top-k)", moe=True, values="int32",
          routing=True),
    Point("expert_weights", "topk", "replicated", _ALL,
          "float32: the routing weight of each chosen expert, in expert_indices' order (after "
          "the model's renormalisation and scaling): the weights vLLM's fused kernel applied",
          moe=True, values="float32", routing=True),
    Point("mlp_out", "d_model", "replicated", _ALL,
          "the MLP (or MoE block) output, before any post-norm and the residual add"),
    Point("mlp_out_post", "d_model", "replicated", ("sandwich",),
          "the MLP output after its post-norm (post_feedforward_layernorm output)"),
    Point("resid_post", "d_model", "replicated", _ALL, "the stream leaving block L"),
    Point("final_norm", "d_model", "replicated", _ALL,
          "the model's final norm applied to the last block's stream (the LM head's input)",
          level="model"),
    Point("logprob", "scalar", "replicated", _ALL,
          "float32: the log-probability the model gives the context's actual next token "
          "(log_softmax of its own final logits, scaling and softcapping included); NaN at a "
          "context's last position (no next token)", level="model", logits=True, values="float32"),
    Point("entropy", "scalar", "replicated", _ALL,
          "float32: the entropy (nats) of the model's next-token distribution (softmax of its "
          "final logits) at every position", level="model", logits=True, values="float32"),
)
BY_NAME = {p.name: p for p in TABLE}
SHARDED_KINDS = frozenset(p.width for p in TABLE if p.tp == "sharded")
NAMES = tuple(BY_NAME)
MODEL_LEVEL = tuple(p.name for p in TABLE if p.level == "model")
LOGIT_POINTS = tuple(p.name for p in TABLE if p.logits)  # no tap: computed after the forward
ROUTING_POINTS = tuple(p.name for p in TABLE if p.routing)  # read from the MoE router's choice
PACKED = {p.name: p.values for p in TABLE if p.values}  # point -> the type of its values

# Points the seed system serves that no table row stands for, and why; asking for one names it.
REFUSED = {
    "lm_head": "the logits are vocab-wide and sharded under TP; capture final_norm",
}


def point(name: str) -> Point:
    """The table row of `name`, or a ValueError naming the known points (or why it is refused)."""
    if name in BY_NAME:
        return BY_NAME[name]
    if name in REFUSED:
        raise ValueError(f"point {name!r} is not served: {REFUSED[name]}")
    raise ValueError(f"unknown point {name!r}: known points are {', '.join(NAMES)}")


def _getter(cfg):
    get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
    text = get("text_config")
    if text is not None:  # multimodal wrappers: the language model's config
        return _getter(text)
    return get


def attention_shape(cfg) -> tuple[int, int, int] | None:
    """(n_heads, n_kv_heads, head_dim) from a Hugging Face config, or None where it does not
    say. KV heads: `num_key_value_heads` (and its other spellings), one for a multi-query model
    (Falcon's old layout, GPTBigCode), else as many as the heads."""
    get = _getter(cfg)
    d = get("hidden_size") or get("n_embd") or get("d_model")
    heads = get("num_attention_heads") or get("n_head")
    head_dim = get("head_dim") or (d // heads if d and heads else None)
    if not heads or not head_dim:
        return None
    if get("multi_query") and not get("new_decoder_architecture"):
        kv = 1
    else:
        kv = get("num_key_value_heads") or get("num_kv_heads") or get("n_head_kv") or heads
    return int(heads), int(kv), int(head_dim)


def config_width(cfg, kind: str) -> int | None:
    """A width kind from a Hugging Face config (a transformers config or its dict); None where
    the config does not say (e.g. `experts` on a dense model)."""
    get = _getter(cfg)
    d = get("hidden_size") or get("n_embd") or get("d_model")
    if kind == "d_model":
        return d
    if kind in ("heads", "kv_heads"):
        shape = attention_shape(cfg)
        if shape is None:
            return None
        heads, kv, head_dim = shape
        return (heads if kind == "heads" else kv) * head_dim
    if kind == "neurons":
        n = get("intermediate_size") or get("n_inner") or get("ffn_hidden_size")
        if n is None and get("model_type") in ("gpt2", "gptj", "falcon") and d:
            n = 4 * d
        return n
    if kind == "experts":
        return get("num_experts") or get("num_local_experts") or get("n_routed_experts")
    if kind == "topk":
        if not config_width(cfg, "experts"):
            return None
        return get("num_experts_per_tok") or get("num_experts_per_token")
    if kind == "scalar":
        return 1
    raise ValueError(f"unknown width kind {kind!r}: use one of {', '.join(WIDTH_KINDS)}")


def kv_replicas(cfg, tp: int) -> int:
    """How many tensor-parallel ranks hold each KV head: vLLM's QKVParallelLinear gives every
    rank one KV head when there are fewer KV heads than ranks (rank r holds head
    r // replicas), else splits the heads over the ranks (1)."""
    shape = attention_shape(cfg)
    if shape is None or shape[1] >= tp:
        return 1
    return tp // shape[1]


def shard_width(cfg, kind: str, tp: int) -> int | None:
    """One tensor-parallel rank's width of a width kind: the whole width for the replicated
    kinds, a 1/tp slice for the sharded ones (`kv_heads`: one KV head per rank when there are
    fewer KV heads than ranks, as vLLM splits them)."""
    w = config_width(cfg, kind)
    if not w or kind not in SHARDED_KINDS or tp <= 1:
        return w
    return w * kv_replicas(cfg, tp) // tp if kind == "kv_heads" else w // tp


def point_width(cfg, name: str) -> int:
    """The width of point `name` in this model (its config), or a ValueError naming why not."""
    p = point(name)
    w = config_width(cfg, p.width)
    if not w:
        raise ValueError(f"point {name!r} ({p.width} wide) does not exist in this model: its "
                         f"config gives no {p.width} width"
                         + (f" ({name} needs a MoE model)" if p.moe else ""))
    return int(w)


def values_per_slot(name: str, dtype) -> int:
    """Elements of the engine dtype `dtype` (a torch dtype or its name) one value of point
    `name` occupies in the tap buffer and the rows: 1 for activations, 4 / element size for a
    point of 32-bit values (two bfloat16 columns per float32/int32)."""
    if name not in PACKED:
        return 1
    size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(dtype).replace("torch.", ""))
    if size is None:
        raise ValueError(f"point {name!r} holds {PACKED[name]} values, which cannot travel in a "
                         f"{dtype} tap buffer: capture it in bfloat16, float16 or float32")
    return 4 // size


def row_width(cfg, name: str, dtype) -> int:
    """Point `name`'s width in rows of the engine dtype `dtype`: its width in values times
    `values_per_slot` (expert_indices of a top-2 model: 4 bfloat16 columns)."""
    return point_width(cfg, name) * values_per_slot(name, dtype)


def table_markdown() -> str:
    """docs/engine.md's point table, generated from TABLE (tests/capture/test_points.py compares)."""
    lines = ["| point | width | under TP | block layouts | meaning |",
             "|---|---|---|---|---|"]
    for p in TABLE:
        where = ", ".join(p.layouts) + {True: " (MoE only)", False: " (dense MLP only)",
                                        None: ""}[p.moe]
        where = where.replace("dense MLP only", "gated dense MLP only") if p.gated else where
        name = f"`{p.name}.0` (model)" if p.level == "model" else f"`{p.name}.L`"
        lines.append(f"| {name} | {p.width} | {p.tp} | {where} | {p.meaning} |")
    return "\n".join(lines)
