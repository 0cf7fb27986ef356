"""SAE quality on fp8 stores against bf16 stores of the same rows, reproducible in one invocation.

    python -m harvest.benchmarks.bench_quant [--quick] [--json] [--out FILE]

One capture of SmolLM2-135M (the engine's eager Hugging Face backend, bf16) at an early, a middle
and a late layer of the same tokens (Python's own documentation, `pydoc_data.topics`, packed in
contexts that start with BOS), written twice: a bfloat16 store and a float8_e4m3fn store (the
writer quantises on the host, bit for bit what the engine does before its device-to-host copy
when `store.dtype: float8_e4m3fn`; tests/store/test_store_fp8.py and test_engine_coverage.py pin the two
quantisers to one numpy reference). On each point, identical TopK SAEs (examples/train_topk.py's
module, the examples' recipe: special tokens out, rows over 10x the median norm out, norm_scale,
10 % of contexts held out) train with the same seed and the same batches on each store, plus a
second bf16 seed as the yardstick of noise. The same three trainings are repeated with a second SAE
kind, the standard ReLU SAE with an L1 penalty (SAELens' `standard`, dictionary_learning's
`AutoEncoder`): its figures sit under the key `relu`, TopK's at the top level.

- `fvu`: fraction of variance unexplained on the held-out rows of the **bf16** store (what the
  activations really are), each SAE with its own training constants;
- `l0`: mean active latents per held-out row; `dead`: fraction of latents never active on them;
- `ce_spliced`: next-token cross-entropy of the model (float32, eager) on held-out contexts when
  the SAE's reconstruction replaces the layer's output at every position but BOS (a forward
  hook), against `ce_clean`.

`--point mlp_act` (or mlp_in, mlp_out, z) studies that point instead of resid_post, at its own
width (mlp_act: the down projection's input, 1,536 wide on SmolLM2, a neuron-basis SAE's rows);
the splice then replaces that module's input or output (SPLICE).

Verdict per layer: fp8 holds when |fvu_fp8 - fvu_bf16| <= max(2 % of fvu_bf16, 2 x |fvu_bf16 -
fvu_bf16_seed2|). The store figures of the same run: stored bytes fp8 / bf16 and the per-row
relative error of the dequantised fp8 rows against the bf16 rows (p50, p99; non-special rows).

`--quick`: 20 k tokens, 200 steps of 512 rows (<= 10 min on 2 idle cores); the default: 65 k
tokens, 600 steps of 1,024 rows (about an hour on 2 shared cores). `--dry` (the suite's check): a tiny model given with `--model`, a few steps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The ReLU SAE's L1 coefficient (the loss is per-dimension MSE + L1 / d * sum of latents): at 2.0,
# 200 steps on SmolLM2's resid_post.15 reach L0 ~40, about TopK's k = 32 (5.0: L0 ~3; 0.5: ~220).
L1 = 2.0
SAE_KINDS = ("topk", "relu")
MODES = {
    "full": dict(contexts=512, ce_contexts=16, context=128, steps=600, batch=1024, expansion=4,
                 k=32, layers=(3, 15, 27), lr=2e-3, l1=L1),
    "quick": dict(contexts=160, ce_contexts=40, context=128, steps=200, batch=512, expansion=4,
                  k=32, layers=(3, 15, 27), lr=2e-3, l1=L1),
    "dry": dict(contexts=24, ce_contexts=2, context=32, steps=8, batch=64, expansion=2, k=8,
                layers=(0, 1, 3), lr=2e-3, l1=L1),
}
KINDS = (("bfloat16", "bfloat16", 0), ("bfloat16_seed2", "bfloat16", 1),
         ("float8_e4m3fn", "float8_e4m3fn", 0))
RECIPE: dict[str, Any] = dict(normalize="norm_scale", exclude_special=True, max_norm_ratio=10.0,
                              test_fraction=0.1, split_seed=0)
REPO = Path(__file__).resolve().parents[1]


def topk_sae_class():
    """examples/train_topk.py's TopKSAE (the examples import their `common` beside them)."""
    ex = str(REPO / "examples")
    if ex not in sys.path:
        sys.path.insert(0, ex)
    return importlib.import_module("train_topk").TopKSAE


def relu_sae_class():
    """The standard SAE (SAELens' `standard`, dictionary_learning's `AutoEncoder`): the TopK SAE's
    parameters and unit-norm decoder rows with a plain ReLU encoder; trained with loss =
    per-dimension MSE + (l1 / d) * sum of latents (`train`)."""
    base = topk_sae_class()

    class ReluSAE(base):
        def __init__(self, d: int, m: int):
            super().__init__(d, m, 0)

        def encode(self, x):
            return ((x - self.b_dec) @ self.W_enc + self.b_enc).relu()

    return ReluSAE


def contexts(tokenizer, n: int, C: int) -> tuple[np.ndarray, list[int]]:
    """[n, C] token ids: documents (pydoc topics, each + EOS) end to end, each context opened by
    BOS (EOS where the tokenizer has none); and the special ids to record."""
    from pydoc_data.topics import topics

    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for key in sorted(topics):
        stream += tokenizer(topics[key], add_special_tokens=False)["input_ids"] + \
            ([eos] if eos is not None else [])
        if len(stream) >= n * (C - 1):
            break
    if len(stream) < n * (C - 1):
        raise ValueError(f"the corpus holds {len(stream):,} tokens, fewer than {n} contexts of {C}")
    body = np.asarray(stream[:n * (C - 1)], np.int32).reshape(n, C - 1)
    ids = np.concatenate([np.full((n, 1), start, np.int32), body], axis=1)
    special = sorted({int(t) for t in (tokenizer.all_special_ids or [])} | {int(start)})
    return ids, special


def capture(model_path: str, ids: np.ndarray, points: list[str]) -> dict[str, np.ndarray]:
    """Rows [n * C, width] per point, bf16, from the engine's eager backend."""
    from ..engine import load_model, to_numpy

    m = load_model(model_path, backend="eager")
    n, C = ids.shape
    out: dict[str, np.ndarray] = {}
    try:
        batches = [ids[i:i + 8].tolist() for i in range(0, n, 8)]
        for req in m.capture(batches, points):
            for pi, p in enumerate(points):
                a = to_numpy(req.acts[pi])
                if p not in out:
                    out[p] = np.zeros((n * C, a.shape[1]), a.dtype)
                out[p][req.index * C:(req.index + 1) * C] = a
    finally:
        m.close()
    return out


def write_store(url: str, dtype: str, acts: dict, ids: np.ndarray, special: list[int]):
    from ..store import create_store, open_store
    from ..testing.synthetic import fill

    points = list(acts)
    n, C = ids.shape
    s = create_store(url, points=points, width=acts[points[0]].shape[1], n_rows=n * C, dtype=dtype,
                     context_size=C, special_token_ids=special, bos_token_id=int(ids[0, 0]))
    s.ledger.write_plan(s.ledger.default_plan(1))
    tok = ids.reshape(-1)
    doc = np.repeat(np.arange(n, dtype=np.int64), C)        # a context is a document here
    pos = np.tile(np.arange(C, dtype=np.int32), n)
    fill(s, np.stack([acts[p] for p in points]), token_id=tok, doc_id=doc, position=pos, chunk=n * C)
    s.finalize({"tokens": n * C})
    return open_store(url, read_only=True)


def stored_bytes(root: str, point: str) -> int:
    d = Path(root, *point.split("."))
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def train(url: str, point: str, seed: int, cfg: dict, kind: str = "topk"):
    """(sae, its training constants): the examples' TopK loop on one store (`kind` "relu": the
    standard L1 SAE, the same loop plus the L1 term)."""
    from ..store.read.adapters import on_device
    from ..store.read.dataset import ActivationDataset

    ds = ActivationDataset(url, points=point, batch_size=cfg["batch"], split="train",
                           steps=cfg["steps"], seed=seed, **RECIPE)
    torch.manual_seed(seed)
    d = ds.width
    m = cfg["expansion"] * d
    sae = topk_sae_class()(d, m, cfg["k"]) if kind == "topk" else relu_sae_class()(d, m)
    opt = torch.optim.Adam(sae.parameters(), lr=cfg["lr"])
    for x in on_device(ds):
        if kind == "topk":
            loss = ((sae(x) - x) ** 2).sum(-1).mean() / d
        else:
            f = sae.encode(x)
            loss = ((f @ sae.W_dec + sae.b_dec - x) ** 2).sum(-1).mean() / d + \
                cfg["l1"] / d * f.sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sae.normalize_decoder()
    return sae, ds.norm_constants


@torch.no_grad()
def evaluate(sae, consts, truth_url: str, point: str) -> dict:
    """fvu, l0, dead on the bf16 store's held-out rows (normalised with the SAE's constants)."""
    from ..store.read.adapters import heldout_fvu, on_device
    from ..store.read.dataset import ActivationDataset

    test = ActivationDataset(truth_url, points=point, batch_size=4096, split="test", shuffle=False,
                             norm_constants=consts, **RECIPE)
    fvu = heldout_fvu(sae, test)
    active, l0, n = None, 0.0, 0
    for x in on_device(test):
        z = sae.encode(x) > 0
        active = z.any(0) if active is None else active | z.any(0)
        l0 += float(z.sum())
        n += x.shape[0]
    return {"fvu": fvu, "l0": l0 / n, "dead": float(1 - active.float().mean())}


# Where each studied point is spliced in a Llama-shaped Hugging Face model (SmolLM2): the module,
# and whether the point is its input or its output. The SAE's reconstruction replaces it there.
SPLICE = {"resid_post": ("", "out"), "mlp_out": ("mlp", "out"), "mlp_in": ("mlp", "in"),
          "mlp_act": ("mlp.down_proj", "in"), "z": ("self_attn.o_proj", "in")}


@torch.no_grad()
def cross_entropy(model, ids: torch.Tensor, point: str | None = None, sae=None, consts=None) -> float:
    """Mean next-token CE on `ids`; with `sae`, its reconstruction replaces `point` (SPLICE: a
    block's output, or a module's input or output inside it) at every position but the first
    (BOS: excluded from training)."""
    handle = None
    if sae is not None:
        shift, scale = consts.shift[0].float(), consts.scale[0].float()
        name, layer = point.split(".")
        path, side = SPLICE[name]
        mod = model.model.layers[int(layer)]
        for part in filter(None, path.split(".")):
            mod = getattr(mod, part)

        def splice(h):
            x = h[:, 1:].float()
            r = sae((x - shift) * scale) / scale + shift
            return torch.cat([h[:, :1], r.to(h.dtype)], dim=1)

        if side == "out":
            def hook(module, args, out):
                if isinstance(out, tuple):
                    return (splice(out[0]), *out[1:])
                return splice(out)
            handle = mod.register_forward_hook(hook)
        else:
            def pre_hook(module, args):
                return (splice(args[0]), *args[1:])
            handle = mod.register_forward_pre_hook(pre_hook)
    try:
        logits = model(ids).logits.float()
    finally:
        if handle is not None:
            handle.remove()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   ids[:, 1:].reshape(-1)))


def run(mode: str = "quick", model: str | None = None, root: str | None = None,
        threads: int | None = None, log=print, saes: tuple[str, ...] = SAE_KINDS, **override) -> dict:
    """One study; `override` replaces settings of the mode (layers, ce_contexts, steps, ...). The
    TopK SAEs' figures are the top-level `bfloat16`, `bfloat16_seed2`, `float8_e4m3fn`, `verdict`
    and `fvu_ok`; every other SAE kind's are the same keys under its name (`relu`)."""
    cfg = {**MODES[mode], **{k: v for k, v in override.items() if v is not None}}
    if threads:
        torch.set_num_threads(threads)
    t0, c0 = time.perf_counter(), time.process_time()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..engine.models import resolve_model
    from ..store.format import fp8

    path = resolve_model(model or "smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    n, n_ce, C = cfg["contexts"], cfg["ce_contexts"], cfg["context"]
    ids, special = contexts(tok, n + n_ce, C)
    train_ids, ce_ids = ids[:n], torch.from_numpy(ids[n:].astype(np.int64))
    point_name = cfg.get("point", "resid_post")
    if point_name not in SPLICE:
        raise ValueError(f"point={point_name!r}: the study splices {', '.join(SPLICE)}")
    points = [f"{point_name}.{L}" for L in cfg["layers"]]
    acts = capture(path, train_ids, points)
    t_cap = time.perf_counter() - t0
    log(f"captured {n * C:,} tokens x {len(points)} points in {t_cap:.0f} s")
    tmp = tempfile.TemporaryDirectory(dir=root)
    urls = {dt: os.path.join(tmp.name, f"{dt}.zarr") for dt in ("bfloat16", "float8_e4m3fn")}
    stores = {dt: write_store(u, dt, acts, train_ids, special) for dt, u in urls.items()}
    keep = ~np.isin(train_ids.reshape(-1), special)
    store_fig: dict[str, Any] = {"bytes": {dt: sum(stored_bytes(u, p) for p in points) for dt, u in urls.items()},
                 "row_rel_err": {}}
    store_fig["fp8_over_bf16"] = store_fig["bytes"]["float8_e4m3fn"] / store_fig["bytes"]["bfloat16"]
    for p in points:
        err = fp8.relative_error(stores["bfloat16"].read(p, 0, n * C)[keep],
                                 stores["float8_e4m3fn"].read(p, 0, n * C)[keep])
        store_fig["row_rel_err"][p] = {"p50": float(np.percentile(err, 50)),
                                       "p99": float(np.percentile(err, 99))}
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    out: dict = {"mode": mode, "model": str(model or "smollm2"), "tokens": n * C,
                 "ce_tokens": int(ce_ids.numel()), "points": points, "settings": cfg,
                 "store": store_fig, "ce_clean": cross_entropy(lm, ce_ids)}
    for kind in saes:
        res: dict[str, Any] = {}
        for name, dt, seed in KINDS:
            per = {}
            for p in points:
                sae, consts = train(urls[dt], p, seed, cfg, kind)
                per[p] = evaluate(sae, consts, urls["bfloat16"], p)
                per[p]["ce_spliced"] = cross_entropy(lm, ce_ids, p, sae, consts)
                log(f"{kind:4s} {name:15s} {p}: " + ", ".join(f"{k} {v:.4f}" for k, v in per[p].items()))
            res[name] = {k: float(np.mean([per[p][k] for p in points]))
                         for k in ("fvu", "l0", "dead", "ce_spliced")}
            res[name]["per_layer"] = per
        res["verdict"] = verdict(res, points)
        res["fvu_ok"] = all(v["ok"] for v in res["verdict"].values())
        if kind == "topk":
            out.update(res)
        else:
            out[kind] = res
    out["saes"] = list(saes)
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time() - c0   # all threads: comparable on a shared box
    tmp.cleanup()
    return out


def verdict(out: dict, points: list[str]) -> dict:
    v = {}
    for p in points:
        b, s2, q = (out[k]["per_layer"][p]["fvu"] for k in ("bfloat16", "bfloat16_seed2", "float8_e4m3fn"))
        spread = abs(b - s2)
        tol = max(0.02 * b, 2 * spread)
        v[p] = {"fvu_diff": q - b, "seed_spread": spread, "tolerance": tol, "ok": abs(q - b) <= tol}
    return v


def _kinds(res: dict) -> list[tuple[str, dict]]:
    """(SAE kind, its figures) for every kind the run trained (TopK's are at the top level)."""
    return [(k, res if k == "topk" else res[k]) for k in res.get("saes", ["topk"])]


def table(res: dict) -> str:
    lines = [f"bench_quant ({res['mode']}): {res['model']}, {res['tokens']:,} tokens, "
             f"CE on {res['ce_tokens']:,} held-out tokens (clean {res['ce_clean']:.4f})",
             f"stored bytes fp8/bf16 {res['store']['fp8_over_bf16']:.3f}; fp8 row error " +
             ", ".join(f"{p} p50 {e['p50']:.2%} p99 {e['p99']:.2%}"
                       for p, e in res["store"]["row_rel_err"].items()),
             f"{'sae':5s}{'point':14s} {'store':15s} {'fvu':>8s} {'l0':>7s} {'dead':>6s} {'ce_spliced':>10s}"]
    for kind, r0 in _kinds(res):
        for p in res["points"]:
            for name, _, _ in KINDS:
                r = r0[name]["per_layer"][p]
                lines.append(f"{kind:5s}{p:14s} {name:15s} {r['fvu']:8.4f} {r['l0']:7.1f} {r['dead']:6.3f} "
                             f"{r['ce_spliced']:10.4f}")
            v = r0["verdict"][p]
            lines.append(f"{'':19s} fp8 - bf16 fvu {v['fvu_diff']:+.4f}, tolerance {v['tolerance']:.4f} "
                         f"(seed spread {v['seed_spread']:.4f}): {'holds' if v['ok'] else 'MISSES'}")
    return "\n".join(lines)


def markdown(res: dict) -> str:
    """The results as RESULTS.md / docs tables."""
    st = res["store"]
    lines = ["| SAE | point | store | held-out FVU | L0 | dead | spliced CE (clean %.4f) |" % res["ce_clean"],
             "|---|---|---|---:|---:|---:|---:|"]
    for kind, r0 in _kinds(res):
        for p in res["points"]:
            for name, _, _ in KINDS:
                r = r0[name]["per_layer"][p]
                lines.append(f"| {kind} | {p} | {name} | {r['fvu']:.4f} | {r['l0']:.1f} | {r['dead']:.3f} | "
                             f"{r['ce_spliced']:.4f} |")
    lines += ["", "| SAE | point | fp8 - bf16 FVU | bf16 seed spread | tolerance | fp8 holds | "
                  "fp8 row error p50 / p99 |", "|---|---|---:|---:|---:|---|---:|"]
    for kind, r0 in _kinds(res):
        for p in res["points"]:
            v, e = r0["verdict"][p], st["row_rel_err"][p]
            lines.append(f"| {kind} | {p} | {v['fvu_diff']:+.4f} | {v['seed_spread']:.4f} | {v['tolerance']:.4f} | "
                         f"{'yes' if v['ok'] else '**no**'} | {e['p50']:.2%} / {e['p99']:.2%} |")
    lines += ["", f"Stored bytes, these points: bf16 {st['bytes']['bfloat16']:,}, fp8 "
                  f"{st['bytes']['float8_e4m3fn']:,} (**{st['fp8_over_bf16']:.3f}x**)."]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="20 k tokens, 200 steps (<= 10 min, 2 cores)")
    g.add_argument("--dry", action="store_true", help="the suite's check: a tiny --model, a few steps")
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    ap.add_argument("--model", default=None, help="model path or name (default: smollm2)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--root", default=None, help="where the two temporary stores go")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="layers (default: the mode's)")
    ap.add_argument("--ce-contexts", type=int, default=None, help="held-out contexts for spliced CE")
    ap.add_argument("--saes", nargs="+", choices=SAE_KINDS, default=list(SAE_KINDS),
                    help="SAE kinds to train (default: both; TopK's figures are the top-level keys)")
    ap.add_argument("--l1", type=float, default=None, help=f"the ReLU SAE's L1 coefficient (default {L1})")
    ap.add_argument("--point", default=None, choices=list(SPLICE),
                    help="the point studied at each layer (default resid_post; mlp_act: the MLP's "
                         "own width, 1,536 on SmolLM2)")
    a = ap.parse_args(argv)
    mode = "quick" if a.quick else "dry" if a.dry else "full"
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.json else print
    res = run(mode, a.model, a.root, a.threads, log=log,
              saes=tuple(a.saes), layers=tuple(a.layers) if a.layers else None,
              ce_contexts=a.ce_contexts, l1=a.l1, point=a.point)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1) if a.json else table(res))


if __name__ == "__main__":
    main()
