"""Attention patterns rebuilt from q and k (store/read/attention.py): seconds and bytes for one
context at a model's shape, against the bytes of the q and k it reads.

    .venv/bin/python -m harvest.benchmarks.bench_attention [--heads 32] [--kv-heads 8]
        [--head-dim 128] [--n 2048] [--repeats 3]

Defaults: an 8B model's attention (Llama-3.1-8B: 32 query heads, 8 KV heads of 128) over one
2,048-token context, all heads at once (the output is heads x n x n float32), and then one head
at a time (what a consumer that inspects a head at a time holds).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from ..store.read.attention import attention_pattern


def run(heads: int = 32, kv_heads: int = 8, head_dim: int = 128, n: int = 2048,
        repeats: int = 3) -> dict:
    rng = np.random.default_rng(0)
    q = torch.tensor(rng.standard_normal((n, heads * head_dim)), dtype=torch.bfloat16)
    k = torch.tensor(rng.standard_normal((n, kv_heads * head_dim)), dtype=torch.bfloat16)
    conf = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    best_all = best_one = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        p = attention_pattern(q, k, conf, 0)
        best_all = min(best_all, time.perf_counter() - t)
        out_bytes = p.numel() * p.element_size()
        del p
        t = time.perf_counter()
        for h in range(heads):
            attention_pattern(q, k, conf, 0, heads=[h])
        best_one = min(best_one, time.perf_counter() - t)
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "n": n,
            "threads": torch.get_num_threads(), "seconds_all_heads": round(best_all, 3),
            "seconds_head_by_head": round(best_one, 3), "pattern_bytes": out_bytes,
            "pattern_bytes_one_head": out_bytes // heads,
            "q_bytes_bf16": q.numel() * 2, "k_bytes_bf16": k.numel() * 2,
            "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(json.dumps(run(a.heads, a.kv_heads, a.head_dim, a.n, a.repeats)))


if __name__ == "__main__":
    main()
