"""What `logprob`/`entropy` add to a forward at Llama-3-8B's shape (issue 47 item 6), torch only.

The next-token scores need the final logits at every row, where a plain prefill computes them
for one row per sequence: the LM head over every row (a [rows, 4096] x [4096, 128256] matmul)
and the vocabulary-wide passes of `engine/capture/scores.py`. Against that stands the forward
itself: 32 decoder layers. A vLLM engine at this shape does not fit this 2-core VM's time, so
this measures the two parts that decide the ratio, side by side in one process on the same
rows, with the engine's own code for the scores:

- one decoder layer at the 8B shape (Hugging Face's LlamaDecoderLayer: GQA 32/8 heads, SwiGLU
  14,336, RoPE, SDPA causal attention over the context), random weights, bf16;
- `scores.scores` with an LM head of the 8B vocabulary (128,256), and the LM head's matmul
  alone (the floor: no implementation of a full-vocabulary log-softmax does less);
- the forward's time as 32 x the layer, the extra as scores over forward.

Rounds alternate layer / head / scores so each meets the same load; medians are reported.
`python -m harvest.benchmarks.bench_scores_share [--tokens 512] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

LAYERS, WIDTH, HEADS, KV_HEADS, FFN, VOCAB = 32, 4096, 32, 8, 14336, 128256


def _layer(dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=WIDTH, intermediate_size=FFN, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, num_hidden_layers=1, vocab_size=VOCAB,
                      max_position_embeddings=8192, rope_theta=500000.0, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(cfg, 0).to(dtype).eval()
    return layer, LlamaRotaryEmbedding(cfg)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> dict:
    from ..engine.capture import scores as sc

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="rows of one context")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    layer, rope = _layer(dtype)
    head = (torch.randn(VOCAB, WIDTH) * WIDTH ** -0.5).to(dtype)
    T = args.tokens
    x = torch.randn(1, T, WIDTH).to(dtype)
    pos = torch.arange(T).unsqueeze(0)
    cos_sin = rope(x, pos)
    nxt = torch.randint(0, VOCAB, (T,))
    nxt[-1] = -1

    def run_layer():
        layer(x, position_embeddings=cos_sin, position_ids=pos, attention_mask=None)

    def run_head():   # every row at once: the matmul's own floor, no chunking
        torch.nn.functional.linear(x[0], head)

    def run_scores():
        sc.scores(x[0], nxt, lambda h: torch.nn.functional.linear(h, head), VOCAB)

    parts = {"layer": run_layer, "head_matmul": run_head, "scores": run_scores}
    with torch.inference_mode():
        for fn in parts.values():   # warm up
            fn()
        times: dict[str, list[float]] = {k: [] for k in parts}
        for r in range(args.rounds):
            order = list(parts) if r % 2 == 0 else list(reversed(parts))
            for k in order:
                times[k].append(_timed(parts[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    forward = LAYERS * med["layer"]
    out = {"shape": f"Llama-3-8B: {LAYERS} layers x {WIDTH}, vocab {VOCAB}", "tokens": T,
           "rounds": args.rounds, "threads": torch.get_num_threads(),
           "layer_s": round(med["layer"], 4), "forward_s (32 x layer)": round(forward, 3),
           "head_matmul_s": round(med["head_matmul"], 4), "scores_s": round(med["scores"], 4),
           "head_matmul / forward": round(med["head_matmul"] / forward, 4),
           "scores / forward": round(med["scores"] / forward, 4),
           "flops: head / (forward + head)": round(
               VOCAB * WIDTH / (LAYERS * (WIDTH * (WIDTH + 2 * WIDTH * KV_HEADS // HEADS + WIDTH)
                                          + 3 * WIDTH * FFN) + VOCAB * WIDTH), 4)}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
