"""The model's own next-token scores per row: `logprob` and `entropy` (engine/points.py).

Both come from the final logits as the model computes them for sampling (its `compute_logits`:
the LM head, then vLLM's logits processor with the model's scale and final softcapping, vocab
shards gathered under tensor parallelism), over every row of a step rather than only the rows
vLLM samples from. The logits are computed in chunks of rows, each chunk reading the whole LM head
(at Llama-3-8B's shape 1 GiB of bf16 weights): chunks of a few dozen rows make those reads cost
more than the matmul (measured on CPU at the 8B shape, `benchmarks/bench_scores_share.py`: 43-row
chunks cost 2.3x the 523-row ones). So a chunk is as many rows as a `[rows, vocab]` float32 block
of `CHUNK_BYTES` holds; on a GPU the softmax temporaries of the whole chunk count too, on a CPU
the element passes go a few rows at a time and only the block counts. Only two float32 values per
row leave the chunk.

- `logprob` of row i: log_softmax(logits_i)[next_i], `next_i` being the token at the following
  position of the same context; a context's last position has no next token and holds NaN.
- `entropy` of row i: -sum_v p_v log p_v of softmax(logits_i), at every position.

The values travel through the tap buffer and the transports like any other point: a float32
occupies `slot_width(dtype)` elements of the engine dtype (two bfloat16 columns, bit for bit:
engine/capture/packed.py), so
every path that moves rows (the buffer, the direct sink, the TP step ring) moves them unchanged;
`unpack` turns them back into float32 on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from . import packed
from .packed import slot_width

__all__ = ["pack", "unpack", "slot_width", "scores", "next_token_ids", "chunk_rows"]

# bound on one chunk's [rows, vocab] float32 block (GPU: and its softmax temporaries), per device
CHUNK_BYTES = 256 << 20
CHUNK_BYTES_GPU = 1 << 30
CPU_PASS_ROWS = 4


def pack(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 [n] -> [n, slot_width(dtype)] of `dtype` holding the same bits."""
    return packed.pack(values.to(torch.float32).reshape(-1), dtype)


def unpack(rows: torch.Tensor) -> torch.Tensor:
    """[n, slot_width] of the engine dtype (as `pack` wrote them) -> float32 [n]."""
    return packed.unpack(rows, "float32").reshape(-1)


def next_token_ids(req_ids, counts, starts, prompts: dict) -> np.ndarray:
    """int64 [n]: the token after each row of a step (request i's rows are positions
    starts[i] .. starts[i] + counts[i] - 1 of `prompts[req_ids[i]]`), -1 where there is none (a
    context's last position, a generated position, or a request whose prompt is unknown)."""
    out = np.full(int(np.sum(counts)), -1, dtype=np.int64)
    row = 0
    for rid, c, s in zip(req_ids, counts, starts):
        c, s = int(c), int(s)
        p = prompts.get(rid)
        if p is not None:
            nxt = p[s + 1:s + 1 + c]
            out[row:row + len(nxt)] = nxt
        row += c
    return out


def chunk_rows(vocab: int, device: torch.device) -> int:
    row = 4 * max(int(vocab), 1)
    if device.type == "cpu":   # passes of CPU_PASS_ROWS rows: their temporaries are small
        return max(1, CHUNK_BYTES // row)
    return max(1, CHUNK_BYTES_GPU // (row * 3))


def scores(hidden: torch.Tensor, next_ids: torch.Tensor, compute_logits, vocab: int):
    """(logprob, entropy), float32 [n] each, of `hidden` [n, d] (the model's final hidden
    states) under `compute_logits`; None where it returns None (a tensor-parallel rank that
    vLLM's logits gather does not give the logits to). Every rank must call it alike: the
    logits gather is a collective."""
    n = hidden.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
    step = chunk_rows(vocab, hidden.device)
    got = True
    # the element passes over a CPU chunk go a few rows at a time, so each row's logits stay in
    # the cache between passes (measured ~1.5-3x faster than whole-chunk passes here)
    sub = CPU_PASS_ROWS if hidden.device.type == "cpu" else step
    for a in range(0, n, step):
        logits = compute_logits(hidden[a:a + step])
        if logits is None:
            got = False
            continue
        rows = logits.shape[0]
        for b in range(0, rows, sub):
            e = min(b + sub, rows)
            lp[a + b:a + e], ent[a + b:a + e] = _row_scores(logits[b:e], next_ids[a + b:a + e])
    return (lp, ent) if got else None


def _row_scores(logits: torch.Tensor, nxt: torch.Tensor):
    logp = torch.log_softmax(logits.float(), dim=-1)
    # p log p is 0 where p is 0 (a -inf logit), not NaN
    ent = -(logp.exp() * logp).nan_to_num(nan=0.0).sum(-1)
    picked = logp.gather(1, nxt.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(nxt >= 0, picked, torch.full_like(picked, float("nan"))), ent
