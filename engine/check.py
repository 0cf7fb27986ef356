"""`check_model`: the user's own model, captured by the engine, against Hugging Face fp32.

Nobody checks the exact model of a billion-token run before it starts; a trunk the probe cannot
verify is refused at load, but a verified trunk can still be wrong for reasons no invariant sees
(a kernel, a dtype, a checkpoint conversion). This runs a few real-text prompts of mixed lengths
through the engine with chunked prefill and through the Hugging Face model in float32, and reports
the per-row relative error at every captured point.

The reference always runs in a subprocess: once vLLM's Transformers backend has loaded a model
(GPT-NeoX, OLMo-2, Starcoder2, ...), that model's HF classes are patched for the whole process and
a plain `from_pretrained` of them fails; a subprocess also keeps the fp32 copy out of the engine
process's memory (on a GPU node the reference runs on the CPU by default).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .addresses import Address
from .protocol import CaptureEngine

# Mixed lengths: one-token prompts, prompts shorter than a step, and prompts spanning several
# 64-token steps (chunked prefill), batched together.
LENGTHS = (5, 37, 150, 64, 90, 17, 1, 120)


# Engine arguments for a freeze-mode engine without vLLM's torch.compile (`-O0`): starts in
# seconds instead of a compile; the taps are the same wrappers, run eagerly.
NO_COMPILE = {"compilation_config": {"mode": 0}}


@dataclass(frozen=True)
class CheckConfig:
    """Pass: at every point, median per-row relative error <= tol_p50 and p99 <= tol_p99.

    A wrong tap (missing or doubled residual, wrong layer) is off on every row (>= 0.3), so the
    median catches it; rows attached to the wrong token are off by ~1 and the p99 catches them
    once they are >= 1% of rows. Both bounds leave room for bf16 against fp32, which grows with
    depth and is uneven across rows: SmolLM2-135M (30 layers), engine vs HF fp32, p50 <= 0.014
    and p99 <= 0.081 at every layer; HF's own bf16 forward vs fp32 on the same rows: p50 <= 0.013,
    p99 <= 0.050, single rows up to 0.26.
    """

    tol_p50: float = 0.03
    tol_p99: float = 0.15
    lengths: tuple[int, ...] = LENGTHS
    seed: int = 0
    reference_device: str = "cpu"
    max_num_batched_tokens: int = 64  # check_model's own engine: small, so prefill is chunked


def check_prompts(path: str, lengths=LENGTHS, seed: int = 0, vocab_size: int | None = None):
    """Real text (Python's own docs) in the model's tokenizer, one slice per length; random ids
    when the checkpoint has no usable tokenizer."""
    rng = np.random.default_rng(seed)
    try:
        from pydoc_data.topics import topics
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        text = "\n".join(topics[k] for k in sorted(topics)[:40])
        ids = tok(text, add_special_tokens=False)["input_ids"]
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        out = []
        for n in lengths:
            start = int(rng.integers(0, max(1, len(ids) - n)))
            out.append((bos + ids[start:start + n])[:n])
        return out
    except Exception:
        if vocab_size is None:
            raise
        return [rng.integers(3, vocab_size, n).tolist() for n in lengths]


def reference(path: str, tokens: list[list[int]], points: list[str], device: str = "cpu",
              revision: str | None = None) -> list[dict[str, torch.Tensor]]:
    """HF fp32 activations, computed in a fresh Python process (see the module docstring)."""
    job = {"path": path, "tokens": tokens, "points": points, "device": device,
           "revision": revision}
    return reference_many([job])[0]


def reference_many(jobs: list[dict], hidden_states: bool = False) -> list[list[dict]]:
    """Several checkpoints' references in one subprocess (one interpreter start for all).

    Each job: {path, tokens, points, device?, revision?}; each result: per prompt, {point: rows}
    and, with hidden_states, HF's own `output_hidden_states` as "hidden.<k>" (k=0: embeddings).
    """
    with tempfile.TemporaryDirectory(prefix="harvest-check-") as d:
        spec, out = Path(d) / "jobs.json", Path(d) / "ref.pt"
        spec.write_text(json.dumps({"jobs": jobs, "hidden_states": hidden_states}))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-m", "harvest.engine.check", str(spec), str(out)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the Hugging Face fp32 reference failed:\n{proc.stderr[-4000:]}")
        return torch.load(out)


@torch.inference_mode()
def _reference_main(spec_path: str, out_path: str) -> None:
    from . import load_model, run_with_cache

    spec = json.loads(Path(spec_path).read_text())
    results = []
    for job in spec["jobs"]:
        ref = load_model(job["path"], backend="eager", dtype="float32",
                         device=job.get("device", "cpu"), revision=job.get("revision"))
        got = [{str(a): t.float().contiguous() for a, t in g.items()}
               for g in run_with_cache(ref, job["tokens"], job["points"])]
        if spec.get("hidden_states"):
            for g, toks in zip(got, job["tokens"]):
                hs = ref.model(torch.tensor([toks], device=ref.device),
                               output_hidden_states=True).hidden_states
                g.update({f"hidden.{k}": h[0].float().cpu() for k, h in enumerate(hs)})
        results.append(got)
        ref.close()
    torch.save(results, out_path)


def row_errors(got: torch.Tensor, ref: torch.Tensor) -> np.ndarray:
    got, ref = got.float().reshape(-1, ref.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    return ((got - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).numpy()


def compare(got: list[dict], ref: list[dict], points: list[str], cfg: CheckConfig) -> dict:
    """Per point: p50/p99/max of per-row relative error over all prompts' rows."""
    per_point = {}
    for p in points:
        a = Address.parse(p)
        errs = np.concatenate([row_errors(g[a], r[p]) for g, r in zip(got, ref)])
        per_point[p] = {"p50": float(np.percentile(errs, 50)), "p99": float(np.percentile(errs, 99)),
                        "max": float(errs.max()), "rows": int(errs.size)}
    for v in per_point.values():
        v["ok"] = v["p50"] <= cfg.tol_p50 and v["p99"] <= cfg.tol_p99
    worst = max(per_point, key=lambda p: per_point[p]["p99"])
    return {"ok": all(v["ok"] for v in per_point.values()),
            "tolerance": {"p50": cfg.tol_p50, "p99": cfg.tol_p99},
            "metric": "per-row relative error vs Hugging Face fp32", "worst_point": worst,
            "points": per_point}


def _measure(model, path: str, tokens, ref, points: list[str], cfg: CheckConfig) -> dict:
    from . import run_with_cache

    got = run_with_cache(model, tokens, points)
    out = compare(got, ref, points, cfg)
    trunk = getattr(getattr(model, "state", None), "layers", None)  # vLLM's probed trunk only
    out.update({"model": model.name, "reference": {"path": path, "dtype": "float32",
                                                    "device": cfg.reference_device},
                "prompts": len(tokens), "tokens": sum(map(len, tokens)),
                "engine": model.describe(), "probe": getattr(trunk, "report", None),
                "config": asdict(cfg)})
    return out


def check_loaded(model: CaptureEngine, reference_path: str | None = None, points=None,
                 cfg: CheckConfig = CheckConfig()) -> dict:
    """Check an already-loaded engine (e.g. a pipeline actor's) and return a JSON-able dict.

    `reference_path` is the checkpoint the reference loads (default: the engine's own); `points`
    default to the engine's frozen reads. The engine keeps its own settings, so prefill is chunked
    only where prompts exceed its max_num_batched_tokens.
    """
    path = reference_path or model.name
    if points is None:
        points = (model.frozen.reads if model.frozen
                  else [f"resid_post.{i}" for i in range(model.n_layers)])
    points = [str(p) for p in points]
    tokens = check_prompts(path, cfg.lengths, cfg.seed, model.info.vocab_size)
    ref = reference(path, tokens, points, cfg.reference_device, model.revision)
    return _measure(model, path, tokens, ref, points, cfg)


def check_model(name_or_path: str, points=None, cfg: CheckConfig = CheckConfig(),
                **engine_args) -> dict:
    """Load `name_or_path` in freeze mode (the mode of a harvest run) with a small
    max_num_batched_tokens so prefill is chunked, check it and close it. The reference is
    computed first, before this process holds an engine."""
    from . import load_model
    from .common import read_model_info
    from .models import resolve_model

    name_or_path = resolve_model(name_or_path)  # smollm2, tiny:<arch> as in load_model
    info = read_model_info(name_or_path, engine_args.get("revision"))
    pts = [str(p) for p in points] if points else [f"resid_post.{i}" for i in range(info.n_layers)]
    tokens = check_prompts(name_or_path, cfg.lengths, cfg.seed, info.vocab_size)
    ref = reference(name_or_path, tokens, pts, cfg.reference_device, engine_args.get("revision"))
    engine_args.setdefault("max_num_batched_tokens", cfg.max_num_batched_tokens)
    model = load_model(name_or_path, backend="vllm", freeze_points=pts, **engine_args)
    try:
        return _measure(model, name_or_path, tokens, ref, pts, cfg)
    finally:
        model.close()


def format_check(result: dict) -> str:
    tol = result["tolerance"]
    lines = [f"{'point':<16} {'p50':>9} {'p99':>9} {'max':>9}   per-row relative error vs HF fp32, "
             f"{result['prompts']} prompts, {result['tokens']} tokens"]
    for p, v in result["points"].items():
        flag = "" if v["ok"] else "  <-- above tolerance"
        lines.append(f"{p:<16} {v['p50']:9.5f} {v['p99']:9.5f} {v['max']:9.5f}{flag}")
    probe = result.get("probe") or {}
    worst = result["points"][result["worst_point"]]
    lines.append(f"{'PASS' if result['ok'] else 'FAIL'}: worst p99 {worst['p99']:.5f} at "
                 f"{result['worst_point']} (tolerance p50 <= {tol['p50']}, p99 <= {tol['p99']}); "
                 f"block probe {'verified' if probe.get('verified') else 'NOT verified'}")
    return "\n".join(lines)


def run_command(path: str, args) -> int:
    """`harvest check-model` (pipeline/cli.py parses the arguments): print the per-point table,
    return 0 on pass, 1 above tolerance or when the trunk is refused at load."""
    from .probe import TrunkRefused

    cfg = CheckConfig(tol_p50=args.tol_p50, tol_p99=args.tol_p99,
                      lengths=tuple(int(n) for n in args.lengths.split(",")),
                      reference_device=args.reference_device)
    engine_args = dict(NO_COMPILE) if args.no_compile else {}
    if args.unverified_trunk:
        engine_args["additional_config"] = {"harvest_unverified_trunk": True}
    try:
        result = check_model(path, points=args.points or None, cfg=cfg, **engine_args)
    except TrunkRefused as e:
        print(f"harvest check-model: REFUSED at load: {e}", file=sys.stderr)
        return 1
    if args.json:  # only the JSON on stdout (pipeline/logs.py json_stdout)
        print(json.dumps(result, indent=2, default=str),
              file=getattr(args, "json_out", None) or sys.stdout)
    else:
        print(format_check(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    _reference_main(sys.argv[1], sys.argv[2])
