"""`check_model`: the user's own model, captured by the engine, against Hugging Face fp32.

Nobody checks the exact model of a billion-token run before it starts; a trunk the probe cannot
verify is refused at load, but a verified trunk can still be wrong for reasons no invariant sees
(a kernel, a dtype, a checkpoint conversion). This runs a few real-text prompts of mixed lengths
through the engine with chunked prefill and through the Hugging Face model in float32 and in the
engine's dtype, and reports the per-row relative error at every captured point, with a bound that
is the bf16 limit of that point (CheckConfig).

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
from typing import Sequence

import numpy as np
import torch

from .addresses import Address
from .capture.captured import run_with_cache
from .checkpoint import read_model_info
from .load import load_model
from .models import resolve_model
from .capture.probe import TrunkRefused
from .protocol import CaptureEngine
from .points import ROUTING_POINTS

# Mixed lengths: one-token prompts, prompts shorter than a step, and prompts spanning several
# 64-token steps (chunked prefill), batched together.
LENGTHS = (5, 37, 150, 64, 90, 17, 1, 120)


# Engine arguments for a freeze-mode engine without vLLM's torch.compile (`-O0`): starts in
# seconds instead of a compile; the taps are the same wrappers, run eagerly.
NO_COMPILE = {"compilation_config": {"mode": 0}}

ROUTING_FLOOR_P50 = 2.0 ** -8   # a bfloat16 step at 1 (expert weights)

# The capture may be this many times as far from HF fp32 as HF's own run in the engine's dtype.
GAP_RATIO = 1.25


@dataclass(frozen=True)
class CheckConfig:
    """Pass: at every point the capture's per-row relative error against HF fp32 is within the
    bf16 limit of this model, measured at check time by running Hugging Face in the engine's
    dtype too (the gap: HF bf16 vs HF fp32, same rows):

    - p50 <= `gap_ratio` x the gap's p50 at that point: the sharp test. Capture and HF bf16
      share the error's source, so their medians agree (SmolLM2-135M, 30 layers: capture / gap
      0.94-1.00 with compile off, 0.73-0.88 compiled; tiny llama 0.93). A constant 0.03 passed a
      capture a few percent wrong on every row of a model whose bf16 gap is 0.01.
    - p99 <= `gap_ratio` x the gap's worst row anywhere in the model. The tail is a handful of
      rows (attention sinks; with 8 prompts the 8 identical BOS rows are p99), where fused or
      compiled kernels round differently: compiled SmolLM2 has p99 0.095 at layer 9 where HF
      bf16's p99 is 0.042 and its worst row 0.072, so no per-point tail figure excuses it, while
      the worst gap row in the model is 0.26. The p99 is there to catch rows attached to the
      wrong token (off by ~1) once they are >= 1% of rows.

    Each bound is at least its floor (an fp32 engine has no gap, yet kernels round differently)
    and at most its cap (`tol_p50`, `tol_p99`: the old constant bounds), so the check is never
    looser than it was.
    """

    tol_p50: float = 0.03  # cap on the p50 bound
    tol_p99: float = 0.15  # cap on the p99 bound
    gap_ratio: float = GAP_RATIO
    floor_p50: float = 0.002
    floor_p99: float = 0.005
    lengths: tuple[int, ...] = LENGTHS
    seed: int = 0
    reference_device: str = "cpu"
    max_num_batched_tokens: int = 64  # check_model's own engine: small, so prefill is chunked

    def routing_bound(self, gap: dict) -> dict:
        """{p50, p99} of expert_indices / expert_weights: from their own gap (HF in the engine's
        dtype routes some near-ties otherwise than fp32: the model, not the capture), its p50
        and its worst row, uncapped; the floors where there is no gap (an fp32 engine), the p50's
        at least a bfloat16 step of a weight near 1 (vLLM's CPU router takes the softmax of the
        top-k in the logits' dtype)."""
        return {"p50": max(self.gap_ratio * gap["p50"], self.floor_p50, ROUTING_FLOOR_P50),
                "p99": max(self.gap_ratio * gap["max"], self.floor_p99)}

    def bound(self, gap_p50: float, gap_tail: float) -> dict:
        """{p50, p99}: one point's bound, from its gap's p50 and the model's worst gap row."""
        clamp = lambda x, lo, hi: min(hi, max(lo, x))  # noqa: E731
        return {"p50": clamp(self.gap_ratio * gap_p50, self.floor_p50, self.tol_p50),
                "p99": clamp(self.gap_ratio * gap_tail, self.floor_p99, self.tol_p99)}


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
              revision: str | None = None, dtype: str = "float32") -> list[dict[str, torch.Tensor]]:
    """HF activations in `dtype` (fp32: the reference), computed in a fresh Python process (see
    the module docstring)."""
    return references(path, tokens, points, device, revision, (dtype,))[0]


def references(path: str, tokens, points: list[str], device: str = "cpu",
               revision: str | None = None, dtypes=("float32",)) -> list[list[dict]]:
    """One reference per dtype, all in one subprocess."""
    job = {"path": path, "tokens": tokens, "points": points, "device": device,
           "revision": revision}
    return reference_many([{**job, "dtype": d} for d in dtypes])


def reference_many(jobs: list[dict], hidden_states: bool = False) -> list[list[dict]]:
    """Several checkpoints' references in one subprocess (one interpreter start for all).

    Each job: {path, tokens, points, device?, revision?, dtype? (float32)}; each result: per
    prompt, {point: rows} and, with hidden_states, HF's own `output_hidden_states` as
    "hidden.<k>" (k=0: embeddings).
    """
    with tempfile.TemporaryDirectory(prefix="harvest-check-") as d:
        spec, out = Path(d) / "jobs.json", Path(d) / "ref.pt"
        spec.write_text(json.dumps({"jobs": jobs, "hidden_states": hidden_states}))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-m", "harvest.engine.model_check", str(spec),
                               str(out)], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [""])[-1]
            if last.startswith("ValueError: "):  # a point the model does not have, by name
                raise ValueError(f"the Hugging Face reference refused: {last[12:]}")
            raise RuntimeError(f"the Hugging Face reference failed:\n{proc.stderr[-4000:]}")
        return torch.load(out)


@torch.inference_mode()
def _reference_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    results = []
    for job in spec["jobs"]:
        ref = load_model(job["path"], backend="eager", dtype=job.get("dtype", "float32"),
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


def row_errors(got: torch.Tensor, ref: torch.Tensor, name: str = "") -> np.ndarray:
    if name == "expert_indices":   # the share of the k chosen experts the reference did not choose
        g, r = got.long().reshape(ref.shape), ref.long()
        hit = (g.unsqueeze(-1) == r.unsqueeze(-2)).any(-1).float()
        return (1.0 - hit.mean(-1)).numpy()
    if ref.dim() == 1:   # one value per row (logprob.0, entropy.0): nats, relative above 1 nat
        got, ref = got.float().reshape(-1), ref.float()
        err = (got - ref).abs() / ref.abs().clamp_min(1.0)
        return torch.where(torch.isnan(got) & torch.isnan(ref), 0.0, err).numpy()
    got, ref = got.float().reshape(-1, ref.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    return ((got - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).numpy()


def errors_by_expert(weights: torch.Tensor, ids: torch.Tensor, ref_weights: torch.Tensor,
                     ref_ids: torch.Tensor) -> np.ndarray:
    """expert_weights' per-row error: the largest difference between the routing as sparse
    vectors over the experts (an expert one side chose and the other did not counts its whole
    weight), so a routing flip weighs here as in expert_indices."""
    ids, ref_ids = ids.long().reshape(ref_ids.shape), ref_ids.long()
    w, rw = weights.float().reshape(ref_weights.shape), ref_weights.float()
    same = ids.unsqueeze(-1) == ref_ids.unsqueeze(-2)                    # [n, k, k]
    theirs = (same.float() * rw.unsqueeze(-2)).sum(-1)                   # ref weight of each of ours
    ours = (same.float() * w.unsqueeze(-1)).sum(-2)                      # our weight of each of theirs
    return torch.maximum((w - theirs).abs().amax(-1),
                         (rw - ours).abs().amax(-1)).numpy()


def _errors(got, ref, p: str, name: str) -> np.ndarray:
    """One prompt's per-row errors at point `p` (`got`: {Address or str: rows}, `ref`: {str:
    rows}); expert_weights by expert, with the same layer's ids from both sides."""
    if name != "expert_weights":
        return row_errors(_at(got, p), ref[p], name)
    ids = f"expert_indices.{Address.parse(p).layer}"
    if ids not in ref:
        raise ValueError(f"{p}: checked by expert, with {ids} beside it: capture both")
    return errors_by_expert(_at(got, p), _at(got, ids), ref[p], ref[ids])


def _at(rows: dict, p: str):
    """rows[p] of a capture's {Address: rows} or a reference's {str: rows}."""
    a = Address.parse(p)
    return rows[a] if a in rows else rows[p]


def _figures(errs: np.ndarray) -> dict:
    return {"p50": float(np.percentile(errs, 50)), "p99": float(np.percentile(errs, 99)),
            "max": float(errs.max())}


def compare(got: Sequence[dict], ref: Sequence[dict], points: list[str], cfg: CheckConfig,
            gap_ref: "list[dict] | None" = None) -> dict:
    """Per point: p50/p99/max of the capture's per-row relative error against HF fp32 (`ref`),
    the same figures of HF's run in the engine's dtype (`gap_ref`; None: the engine runs fp32,
    no gap) and the bound they give (CheckConfig)."""
    zero = {"p50": 0.0, "p99": 0.0, "max": 0.0}
    name = {p: Address.parse(p).name for p in points}
    gaps = {p: zero if gap_ref is None else _figures(
        np.concatenate([_errors(g, r, p, name[p]) for g, r in zip(gap_ref, ref)]))
        for p in points}
    # routing flips on near-ties are the model's dtype (docs/engine.md "MoE routing"): they
    # bound their own point, never the activations' tail
    tail = max([g["max"] for p, g in gaps.items() if name[p] not in ROUTING_POINTS], default=0.0)
    per_point = {}
    for p in points:
        errs = np.concatenate([_errors(g, r, p, name[p]) for g, r in zip(got, ref)])
        bound = cfg.routing_bound(gaps[p]) if name[p] in ROUTING_POINTS else \
            cfg.bound(gaps[p]["p50"], tail)
        v = {**_figures(errs), "rows": int(errs.size), "gap": gaps[p], "bound": bound}
        v["ok"] = v["p50"] <= v["bound"]["p50"] and v["p99"] <= v["bound"]["p99"]
        per_point[p] = v
    worst = max(per_point, key=lambda p: max(per_point[p][q] / per_point[p]["bound"][q]
                                             for q in ("p50", "p99")))
    return {"ok": all(v["ok"] for v in per_point.values()),
            "tolerance": {"p50": cfg.tol_p50, "p99": cfg.tol_p99, "gap_ratio": cfg.gap_ratio,
                          "floor_p50": cfg.floor_p50, "floor_p99": cfg.floor_p99,
                          "gap_tail": tail},
            "metric": "per-row relative error vs Hugging Face fp32; gap: Hugging Face in the "
                      "engine's dtype vs fp32", "worst_point": worst, "points": per_point}


def _dtype(engine_dtype) -> str:
    return str(engine_dtype or "bfloat16").replace("torch.", "")


def _refs(path: str, tokens, points: list[str], cfg: CheckConfig, revision, engine_dtype: str):
    """(HF fp32, HF in the engine's dtype or None when that is fp32)."""
    dtypes = ("float32",) if engine_dtype == "float32" else ("float32", engine_dtype)
    got = references(path, tokens, points, cfg.reference_device, revision, dtypes)
    return got[0], (got[1] if len(got) > 1 else None)


def _measure(model, path: str, tokens, refs, points: list[str], cfg: CheckConfig,
             engine_dtype: str) -> dict:
    got = run_with_cache(model, tokens, points)
    out = compare(got, refs[0], points, cfg, refs[1])
    trunk = getattr(getattr(model, "state", None), "layers", None)  # vLLM's probed trunk only
    out.update({"model": model.name, "reference": {"path": path, "dtype": "float32",
                                                    "gap_dtype": engine_dtype,
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
    dtype = _dtype(model.describe().get("dtype"))
    refs = _refs(path, tokens, points, cfg, model.revision, dtype)
    return _measure(model, path, tokens, refs, points, cfg, dtype)


def expand_points(points, n_layers: int) -> list[str]:
    """Addresses as given, `name.*` expanded to every layer (`name.0` for a model-level point):
    `harvest check-model smollm2 --points mlp_in.* mlp_act.*` checks a transcoder's points and
    the MLP's hidden units (at its own width) at every layer."""
    from .points import MODEL_LEVEL

    out: list[str] = []
    for p in points:
        name, _, layer = str(p).rpartition(".")
        if layer != "*":
            out.append(str(p))
        else:
            out += [f"{name}.0"] if name in MODEL_LEVEL else [f"{name}.{i}" for i in range(n_layers)]
    return out


def check_model(name_or_path: str, points=None, cfg: CheckConfig = CheckConfig(),
                **engine_args) -> dict:
    """Load `name_or_path` in freeze mode (the mode of a harvest run) with a small
    max_num_batched_tokens so prefill is chunked, check it and close it. The reference is
    computed first, before this process holds an engine."""
    name_or_path = resolve_model(name_or_path)  # smollm2, tiny:<arch> as in load_model
    info = read_model_info(name_or_path, engine_args.get("revision"))
    pts = expand_points(points or ["resid_post.*"], info.n_layers)
    # expert_weights are checked by expert: the same layer's ids come along
    pts += [i for p in pts if p.startswith("expert_weights.")
            and (i := p.replace("expert_weights.", "expert_indices.")) not in pts]
    tokens = check_prompts(name_or_path, cfg.lengths, cfg.seed, info.vocab_size)
    dtype = _dtype(engine_args.get("dtype"))  # the vLLM backend's default: bfloat16
    refs = _refs(name_or_path, tokens, pts, cfg, engine_args.get("revision"), dtype)
    engine_args.setdefault("max_num_batched_tokens", cfg.max_num_batched_tokens)
    model = load_model(name_or_path, backend="vllm", freeze_points=pts, **engine_args)
    try:
        return _measure(model, name_or_path, tokens, refs, pts, cfg, dtype)
    finally:
        model.close()


def format_check(result: dict) -> str:
    """The per-point table: the capture's error, HF's own error in the engine's dtype (the gap)
    and the bound the gap gives, all against HF fp32."""
    tol = result["tolerance"]
    gap_dtype = (result.get("reference") or {}).get("gap_dtype", "bf16")
    lines = [f"{'point':<16} {'p50':>9} {'p99':>9} {'max':>9} | {'gap p50':>9} {'gap p99':>9} "
             f"{'gap max':>9} | {'bound p50':>9} {'bound p99':>9}   per-row relative error vs "
             f"HF fp32 (gap: HF {gap_dtype} vs fp32), {result['prompts']} prompts, "
             f"{result['tokens']} tokens"]
    for p, v in result["points"].items():
        flag = "" if v["ok"] else "  <-- above tolerance"
        gap, bound = v.get("gap") or {}, v.get("bound") or {}
        nan = float("nan")
        lines.append(f"{p:<16} {v['p50']:9.5f} {v['p99']:9.5f} {v['max']:9.5f} | "
                     f"{gap.get('p50', nan):9.5f} {gap.get('p99', nan):9.5f} "
                     f"{gap.get('max', nan):9.5f} | "
                     f"{bound.get('p50', nan):9.5f} {bound.get('p99', nan):9.5f}{flag}")
    probe = result.get("probe") or {}
    worst = result["points"][result["worst_point"]]
    rule = (f"bounds: p50 {tol['gap_ratio']:g} x gap p50, p99 {tol['gap_ratio']:g} x the "
            f"worst gap row {tol['gap_tail']:.4f}; at least {tol['floor_p50']:g} / "
            f"{tol['floor_p99']:g}, at most {tol['p50']:g} / {tol['p99']:g}"
            if "gap_ratio" in tol else f"tolerance p50 <= {tol['p50']}, p99 <= {tol['p99']}")
    within = "".join(f", {q} {worst[q]:.5f}" + (f" of {worst['bound'][q]:.5f}"
                                                  if "bound" in worst else "")
                     for q in ("p50", "p99"))
    lines.append(f"{'PASS' if result['ok'] else 'FAIL'}: closest to its bound "
                 f"{result['worst_point']}{within} ({rule}); "
                 f"block probe {'verified' if probe.get('verified') else 'NOT verified'}")
    return "\n".join(lines)


def run_command(path: str, args) -> int:
    """`harvest check-model` (pipeline/cli/commands/check_model.py parses the arguments): print
    the per-point table, return 0 on pass, 1 above tolerance or when the trunk is refused at
    load."""
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
    except ValueError as e:  # a point this model does not have (named, with the reason)
        print(f"harvest check-model: REFUSED: {e}", file=sys.stderr)
        return 1
    if args.json:  # only the JSON on stdout (pipeline/logs.py json_stdout)
        print(json.dumps(result, indent=2, default=str),
              file=getattr(args, "json_out", None) or sys.stdout)
    else:
        print(format_check(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    _reference_main(sys.argv[1], sys.argv[2])
