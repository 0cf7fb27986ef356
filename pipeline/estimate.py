"""`harvest plan`'s estimates: tokens, stored size and time of a run, before anything runs.

Rough by design (text bytes per token and tok/s from model size), and labelled so; what they
prevent is the surprise: a budget the corpus cannot fill (`packing.max_tokens=5000000` on a
220k-token corpus used to say nothing until the summary), or a store that will not fit.
"""

from __future__ import annotations

import os

# Text bytes per token. Measured: SmolLM2's tokenizer on the pydoc corpus (jsonl, 488 kB) gave
# ~220k tokens, ~2.2 bytes per token (code and JSON escapes); English prose is ~4. 3 is between.
BYTES_PER_TOKEN = 3.0
# A budget this much above the corpus estimate gets a warning (the estimate is rough).
BUDGET_SLACK = 1.5
# Compression of bf16 activations with the default codec (README: ~1.42-1.46x on SmolLM2).
DEFAULT_RATIO = 1.4
# tok/s per CPU thread ~ CPU_RATE / parameters (SmolLM2-135M: ~1.5k tok/s per thread, FIELD-NOTES);
# per GPU ~ GPU_RATE / parameters, capped (prefill at ~40% of an H100's bf16 peak).
CPU_RATE = 2e11
GPU_RATE = 2e14
GPU_CAP = 100_000.0
# Engine start: compile on the first start on a host, the compile cache afterwards.
START_SECONDS = {"cpu": 60.0, "gpu": 120.0}


def corpus_bytes(sources: dict) -> "int | None":
    """Text bytes of line-based sources (jsonl/json/text/csv), from the plan's byte ranges."""
    total = 0
    for block in sources.get("blocks") or []:
        for seg in block:
            if seg.get("kind") != "lines":
                return None
            total += int(seg["stop"]) - int(seg["start"])
    return total or None


def params(prep) -> float:
    return 12.0 * prep.n_layers * prep.width ** 2 + prep.vocab_size * prep.width


def _platform() -> str:
    try:
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "cpu"


def plan_estimate(cfg, prep, out: dict) -> "tuple[dict, list[str]]":
    """(estimate, warnings) for `harvest plan`; see plan_text for how they are shown."""
    warnings: list[str] = []
    text = corpus_bytes(prep.sources)
    corpus_tokens = int(text / BYTES_PER_TOKEN) if text else None
    budget = cfg.packing.max_tokens
    if budget and corpus_tokens and budget > BUDGET_SLACK * corpus_tokens:
        warnings.append(
            f"packing.max_tokens={budget:,} is more than the corpus likely holds "
            f"(~{corpus_tokens:,} tokens from {text / 1e6:.1f} MB of text at ~{BYTES_PER_TOKEN:g} bytes per token): "
            "the run will stop at the end of the corpus, short of the budget")
    if out.get("planned_tokens") and out.get("plan_complete"):
        tokens, source = out["planned_tokens"], "the stored plan"
    elif budget and (not corpus_tokens or budget <= corpus_tokens):
        tokens, source = budget, "packing.max_tokens"
    elif corpus_tokens:
        tokens = corpus_tokens if not budget else min(budget, corpus_tokens)
        source = f"~{BYTES_PER_TOKEN:g} text bytes per token"
    else:
        return {"tokens": None}, warnings
    plat = _platform()
    n = params(prep)
    actors = cfg.ray.num_actors
    if plat == "gpu":
        per_actor = min(GPU_CAP, GPU_RATE / n)
    else:
        threads = cfg.ray.threads_per_actor or max(1, (os.cpu_count() or 1) // actors)
        per_actor = CPU_RATE / n * threads
    rate = per_actor * actors
    ratio = 1.0 if cfg.store.compression in ("none", None) else DEFAULT_RATIO
    logical = tokens * out["bytes_per_token"]
    return {
        "tokens": int(tokens), "tokens_source": source, "bytes_logical": int(logical),
        "compression": ratio, "bytes_stored": int(logical / ratio),
        "tokens_per_second": round(rate), "seconds": START_SECONDS[plat] + tokens / rate,
        "rate_note": f"guess: ~{rate:,.0f} tok/s for {actors} {plat.upper()} actors of a "
                     f"{n / 1e9:.2g}B model, plus engine start",
    }, warnings
