"""`harvest plan`'s estimates: tokens, stored size and time of a run, before anything runs.

Rough by design (text bytes per token; tok/s measured where a figure exists, else from model
size), and labelled so; what they
prevent is the surprise: a budget the corpus cannot fill (`packing.max_tokens=5000000` on a
220k-token corpus is said before the run, not in its summary), or a store that will not fit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...store import fp8 as _fp8

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


# Parquet text expands by about this much from its compressed file (snappy/zstd on prose: 2-4x);
# the larger figure keeps the bound an upper bound, so a warning from it is a sure one.
PARQUET_EXPANSION = 4.0


def corpus_bound(sources: dict, block_bytes: int) -> "tuple[int, str] | None":
    """An upper bound on the corpus's text bytes where it is known only from metadata, with how:
    parquet files' sizes times PARQUET_EXPANSION, a `save_to_disk` dataset's blocks times
    data.block_bytes (each block holds at most that much). None for line-based sources (exact:
    corpus_bytes) and hub/streaming datasets (unknown without reading them)."""
    blocks = sources.get("blocks") or []
    kinds = {seg.get("kind") for b in blocks for seg in b}
    if kinds == {"parquet"}:
        sizes = {seg["path"]: int(seg.get("size") or 0) for b in blocks for seg in b}
        n = int(sum(sizes.values()) * PARQUET_EXPANSION)
        return n, f"{len(sizes)} parquet file(s) of {sum(sizes.values()) / 1e6:.1f} MB x {PARQUET_EXPANSION:g}"
    if kinds == {"disk"}:
        rows = max(int(seg.get("rows") or 0) for b in blocks for seg in b)
        return len(blocks) * block_bytes, f"{rows:,} rows in {len(blocks)} block(s) of at most " \
                                          f"data.block_bytes={block_bytes:,}"
    return None


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


BENCH_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "results.json"


def store_rate(cfg, store) -> "dict | None":
    """The store's own measured rate: its newest run (a scheduled tick's record, else the final
    summary) per actor, times this config's actors. The best figure there is: this model, this
    corpus, this cluster's kind, measured end to end."""
    from ..driver.schedule_log import read_ticks

    runs = [t.get("summary") or {} for t in read_ticks(store.location)]
    runs += [store.summary] if store.summary else []
    for r in reversed(runs):
        n = len(r.get("per_actor") or [])
        if r.get("tokens_per_second") and n:
            per_actor = float(r["tokens_per_second"]) / n
            rate = per_actor * cfg.ray.num_actors
            return {"tokens_per_second": round(rate),
                    "rate_note": f"measured: ~{rate:,.0f} tok/s for {cfg.ray.num_actors} actors "
                                 "at this store's last run's pace, plus engine start",
                    "rate_source": f"measured: this store's last run ({r.get('tokens_this_run', 0):,} "
                                   f"tokens at {float(r['tokens_per_second']):,.0f} tok/s on {n} "
                                   f"actors, finished {r.get('finished_at') or 'paused'}), "
                                   f"scaled to ray.num_actors={cfg.ray.num_actors}"}
    return None


def bench_rate(cfg, prep, plat: str, path: Path = BENCH_RESULTS) -> "dict | None":
    """The freeze engine's measured tok/s from benchmarks/results/ when it measured this model's
    shape on this kind of device, per core, scaled to the actors' threads; None otherwise."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    shape = d.get("tokens") or {}
    dev = (d.get("machine") or {}).get("device")
    if dev != plat or (shape.get("n_layers"), shape.get("width")) != (prep.n_layers, prep.width):
        return None
    rows = ((d.get("sections") or {}).get("engine") or {}).get("rows") or []
    freeze = [r["tok_s"] for r in rows if r.get("mode") == "freeze" and r.get("tok_s")]
    cores = (d.get("machine") or {}).get("cpus") or 1
    if not freeze:
        return None
    actors = cfg.ray.num_actors
    if plat == "cpu":
        threads = cfg.ray.threads_per_actor or max(1, (os.cpu_count() or 1) // actors)
        per_actor, scale = max(freeze) / cores * threads, f"{threads} thread(s) per actor"
    else:
        per_actor, scale = max(freeze), "one GPU per actor"
    rate = per_actor * actors
    return {"tokens_per_second": round(rate),
            "rate_note": f"measured engine rate: ~{rate:,.0f} tok/s for {actors} "
                         f"{plat.upper()} actors, plus engine start",
            "rate_source": f"measured: {d.get('model_name')} freeze engine {max(freeze):,.0f} tok/s "
                           f"on {cores} {plat.upper()} cores ({path.parent.name}/{path.name}, "
                           f"{d.get('started')}), scaled to {scale}; the engine alone: a run "
                           "end to end went at 0.4-0.7x of it there"}


def plan_estimate(cfg, prep, out: dict, rate: "float | None" = None,
                  ratio: "float | None" = None, store=None) -> "tuple[dict, list[str]]":
    """(estimate, warnings) for `harvest plan`; see plan_text for how they are shown. The rate is,
    first found: `rate` (tok/s, `plan --rate`), the store's own history (`store`: an existing
    store's last run or tick), benchmarks/results/ (this model shape on this device kind), a guess
    from model size; `rate_source` says which. `ratio` is the codec's expected compression
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
    bound = None if text else corpus_bound(prep.sources, cfg.data.block_bytes)
    if bound and budget and budget > bound[0] / BYTES_PER_TOKEN:
        # an upper bound, so the warning is sure; the estimate still prices the budget (the
        # bound can be far above the real count: it would not make a better token figure)
        warnings.append(
            f"packing.max_tokens={budget:,} is more than the corpus can hold (at most "
            f"~{int(bound[0] / BYTES_PER_TOKEN):,} tokens: {bound[1]}, at ~{BYTES_PER_TOKEN:g} bytes per token): the "
            "run will stop at the end of the corpus, short of the budget; add data or lower "
            "packing.max_tokens")
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
    measured = store_rate(cfg, store) if store is not None else None
    if measured is None:
        measured = bench_rate(cfg, prep, r["rate_platform"])
        if measured:  # the device kind is still a choice: say why this one
            measured["rate_source"] += f" ({platform(cfg)[1]})"
    if measured:
        r.update(measured)
    if rate:
        r.update(tokens_per_second=round(rate), rate_note=f"{rate:,.0f} tok/s given with --rate, "
                 "plus engine start", rate_source=f"given with --rate {rate:g}, instead of "
                 f"~{r['tokens_per_second']:,} tok/s, the {r['rate_source']}")
    if ratio is None:
        # None is the dtype's default codec, not "none"
        ratio = _fp8.expected_ratio(cfg.store.compression, cfg.store_dtype())
    logical = tokens * out["bytes_per_token"]
    return {
        "tokens": int(tokens), "tokens_source": source, "bytes_logical": int(logical),
        "compression": ratio, "bytes_stored": int(logical / ratio),
        "seconds": START_SECONDS[r["rate_platform"]] + tokens / max(1, r["tokens_per_second"]),
        **r,
    }, warnings


def dataplane(cfg, est: dict, bytes_per_token: int, codec,
              dtype: str = "bfloat16") -> "tuple[dict | None, list[str]]":
    """(figures, warnings): the host CPU the write path needs at the planned rate, per GPU (per
    actor on CPU runs), against what the config reserves (`ray.num_cpus_per_actor`). The write
    path's core-seconds per GB are compression.write_core_s_per_gb (measured, bench_dataplane);
    bytes are the rows as captured, at 2 bytes a number (what the figure is per), whatever the
    store's `dtype` (an fp8 store's write path moves half of them: its own measured figure)."""
    from ...store import compression

    rate = est.get("tokens_per_second")
    if not rate:
        return None, []
    plat = est.get("rate_platform", "cpu")
    actors = cfg.ray.num_actors
    tp = cfg.model.tensor_parallel_size
    gpus_per_actor = max(float(cfg.ray.num_gpus_per_actor or 1.0), float(tp)) if plat == "gpu" else 0.0
    per = "GPU" if plat == "gpu" else "actor"
    units = actors * gpus_per_actor if plat == "gpu" else actors
    gb_s = rate * bytes_per_token / 1e9 / units   # per GPU (or actor)
    core_s = compression.write_core_s_per_gb(_fp8.compression_for(codec, dtype), dtype)
    need = gb_s * core_s
    cpus, _ = cfg.ray.actor_resources({"GPU": 1} if plat == "gpu" else {})
    have = cpus / gpus_per_actor if plat == "gpu" else cpus
    out = {"per": per, "gb_per_second_per": round(gb_s, 3), "write_core_s_per_gb": core_s,
           "cores_needed_per": round(need, 2), "cores_reserved_per": round(have, 2),
           "tokens_per_second_per": round(rate / units), "source": compression.WRITE_CORE_S_SOURCE}
    warnings = []
    if plat == "gpu" and need > have:
        want = -(-need * gpus_per_actor // 1)
        warnings.append(
            f"the data plane needs ~{need:.1f} host cores per GPU at {rate / units:,.0f} tok/s per GPU "
            f"({gb_s:.2f} GB/s of rows x {core_s:g} core-s/GB: buffers, codec, CRCs, statistics, "
            f"upload), but ray.num_cpus_per_actor={cpus:g} reserves {have:g} per GPU: set "
            f"ray.num_cpus_per_actor={want:g} (the node must have them: an 8xH100 node has ~12 "
            f"physical cores per GPU), or capture fewer points{_fp8_hint(dtype)}")
    return out, warnings


def _fp8_hint(dtype: str) -> str:
    """The cheaper dtype, where the store is not fp8 already (its measured write-path CPU)."""
    from ...store import compression

    if dtype == "float8_e4m3fn":
        return ""
    fp8 = "float8_e4m3fn"
    core_s = compression.write_core_s_per_gb(_fp8.compression_for(None, fp8), fp8)
    return (f", or store.dtype={fp8} ({core_s:g} core-s/GB, half the bytes; see docs/store.md)")
