"""`harvest plan`'s estimates: tokens, stored size and time of a run, before anything runs.

Rough by design (text bytes per token and tok/s from model size), and labelled so; what they
prevent is the surprise: a budget the corpus cannot fill (`packing.max_tokens=5000000` on a
220k-token corpus used to say nothing until the summary), or a store that will not fit.
"""

from __future__ import annotations

import os

from .store.compression import expected_ratio

# Text bytes per token. Measured: SmolLM2's tokenizer on the pydoc corpus (jsonl, 488 kB) gave
# ~220k tokens, ~2.2 bytes per token (code and JSON escapes); English prose is ~4. 3 is between.
BYTES_PER_TOKEN = 3.0
# A budget this much above the corpus estimate gets a warning (the estimate is rough).
BUDGET_SLACK = 1.5
# tok/s per CPU thread ~ CPU_RATE / parameters (SmolLM2-135M: ~1.5k tok/s per thread, FIELD-NOTES);
# per GPU ~ GPU_RATE / parameters, capped (prefill at ~40% of an H100's bf16 peak).
CPU_RATE = 2e11
GPU_RATE = 2e14
GPU_CAP = 100_000.0
# benchmarks/results/ holds CPU figures only (its header says so; no GPU was lent to the session
# that wrote the suite): a GPU rate is a guess from model size until GPU figures are measured.
GPU_RATE_SOURCE = ("guess from model size: prefill at ~40% of an H100's bf16 peak, capped at "
                   f"{GPU_CAP:,.0f} tok/s per actor; no measured GPU rate is known "
                   "(benchmarks/results/ holds CPU figures only)")
CPU_RATE_SOURCE = ("guess from model size: ~1.5k tok/s per thread for SmolLM2-135M "
                   "(FIELD-NOTES), scaled by parameters")
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


def _local_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def platform(cfg) -> "tuple[str, str]":
    """("gpu" | "cpu", why) for the actors the run asks for. `ray.num_gpus_per_actor` decides
    when set (a GPU cluster is priced at GPU rates from a CPU laptop: pricing where `plan` runs
    was how 8B runs came out at CPU rates); unset, the actors get a GPU where the cluster has
    one, and `plan` can only look at this machine."""
    g = cfg.ray.num_gpus_per_actor
    if g is not None:
        return ("gpu" if g > 0 else "cpu"), f"ray.num_gpus_per_actor={g:g}"
    if _local_gpu():
        return "gpu", "this machine has a GPU and ray.num_gpus_per_actor is unset"
    return "cpu", ("ray.num_gpus_per_actor is unset and this machine has no GPU: CPU rates; a GPU "
                   "cluster gives each actor one, set ray.num_gpus_per_actor=1 to price that")


def guess_rate(cfg, prep) -> dict:
    """Aggregate tok/s of the run's actors, with where the figure comes from."""
    plat, why = platform(cfg)
    n = params(prep)
    actors = cfg.ray.num_actors
    tp = cfg.model.tensor_parallel_size
    if plat == "gpu":
        # A TP=k actor spans k GPUs: priced as k GPUs' worth of prefill (linear scaling is a
        # guess; all-reduces cost some of it). The cap is per GPU.
        per_actor = min(GPU_CAP, GPU_RATE / n) * tp
    else:
        threads = cfg.ray.threads_per_actor or max(1, (os.cpu_count() or 1) // actors)
        per_actor = CPU_RATE / n * threads
    rate = per_actor * actors
    source = GPU_RATE_SOURCE if plat == "gpu" else CPU_RATE_SOURCE
    return {"tokens_per_second": round(rate), "rate_platform": plat,
            "rate_note": f"guess: ~{rate:,.0f} tok/s for {actors} {plat.upper()} actors of a "
                         f"{n / 1e9:.2g}B model"
                         + (f" at tensor_parallel_size={tp} ({actors * tp} GPUs)"
                            if tp > 1 and plat == "gpu" else "") + ", plus engine start",
            "rate_source": f"{plat.upper()} {source} ({why})"}


def plan_estimate(cfg, prep, out: dict, rate: "float | None" = None,
                  ratio: "float | None" = None) -> "tuple[dict, list[str]]":
    """(estimate, warnings) for `harvest plan`; see plan_text for how they are shown. `rate`
    (tok/s, `plan --rate`) replaces the guessed rate; `ratio` is the codec's expected compression
    (default: of store.compression)."""
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
    r = guess_rate(cfg, prep)
    if rate:
        r.update(tokens_per_second=round(rate), rate_note=f"{rate:,.0f} tok/s given with --rate, "
                 "plus engine start", rate_source=f"given with --rate {rate:g}, instead of "
                 f"~{r['tokens_per_second']:,} tok/s, the {r['rate_source']}")
    if ratio is None:
        ratio = expected_ratio(cfg.store.compression)  # None is the default codec, not "none"
    logical = tokens * out["bytes_per_token"]
    return {
        "tokens": int(tokens), "tokens_source": source, "bytes_logical": int(logical),
        "compression": ratio, "bytes_stored": int(logical / ratio),
        "seconds": START_SECONDS[r["rate_platform"]] + tokens / max(1, r["tokens_per_second"]),
        **r,
    }, warnings
