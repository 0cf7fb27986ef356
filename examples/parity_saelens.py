"""SAE quality parity: a TopK SAE trained from a harvest store vs one from SAELens's own cache.

    .venv-trainers/bin/python examples/parity_saelens.py --store <url> --point resid_post.15 \\
        --saelens-cache /tmp/saelens-cache --steps 1000

Both sides hold the same tokens at the same hook: harvest's rows were captured by vLLM (bf16);
SAELens's are cached by SAELens itself (`CacheActivationsRunner`, model_class_name=
"AutoModelForCausalLM", fp32 Hugging Face forward of the same checkpoint, hook `model.layers.L`
= resid_post of layer L), built here from the store's own token ids when `--saelens-cache` does
not exist yet. It runs in `.venv-trainers`: its sae-lens 6.54 / transformers 5.25 / datasets 5.2
cache offline from the local checkpoint, so no second venv is needed (benchmarks/peer_saelens.py
is the same runner, used there for speed).

What is held equal, so the FVUs differ only by the activations themselves:
- rows: harvest's reader picks them (the examples' recipe: context position 0 out, rows over 10x
  the median norm out, a held-out split by document); the SAELens side takes the SAME row ids
  from its cache, in the SAME order, batch by batch (the train stream is recorded as it is read);
- normalisation: E||x||^2 = width on the train rows, each source with its own constant (harvest:
  the reader's; SAELens: recomputed from its cache over the train rows);
- model: SAELens's TopKTrainingSAE + SAETrainer for both, same seed (same initial weights),
  hyper-parameters, steps and batch size.
Reported: held-out FVU of each on its own source's held-out rows, their ratio, the fraction of
latents never active on the held-out rows, and how far apart the two sources' rows are.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Offline before anything imports HF or wandb: a hub lookup would hang on a closed network.
for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

import numpy as np
import torch  # noqa: E402
from common import REPO, parser, recipe_kwargs, report

from harvest.store import ActivationDataset, heldout_fvu, open_store


def store_tokens(store) -> np.ndarray:
    """The store's token ids as [n_contexts, context_size]: what SAELens is fed, unchanged.

    Checked: every row written and contexts aligned to multiples of the context size (with BOS
    per context, each context's row 0 is the inserted BOS), so cache row (i, j) is store row
    i * C + j.
    """
    c = store.context_size
    tok, doc, _ = store.read_row_meta(0, store.n_rows)
    tok, doc = np.asarray(tok), np.asarray(doc)
    if c is None or store.n_rows % c or (doc == -1).any():
        raise SystemExit(f"{store.url}: needs a complete store of whole contexts "
                         f"(context_size={c}, {store.n_rows} rows, {(doc == -1).sum()} unwritten)")
    bos = ((store.attrs.get("config") or {}).get("packing") or {}).get("bos", "context")
    if bos == "context" and not (doc[::c] == -2).all():
        raise SystemExit(f"{store.url}: contexts are not aligned to multiples of {c} rows")
    return tok.reshape(-1, c).astype(np.int64)


def model_batch(n_ctx: int, want: int) -> int:
    """Largest batch <= want dividing n_ctx: SAELens's runner wraps around the dataset when the
    buffers do not tile it, which would cache some contexts twice and shift rows."""
    return max(b for b in range(1, min(want, n_ctx) + 1) if n_ctx % b == 0)


def build_saelens_cache(model_dir: str, tokens: np.ndarray, layer: int, out: Path,
                        batch: int, model_dtype: str) -> str:
    """SAELens caches resid_post of `layer` for exactly `tokens`; returns the hook (column) name."""
    import datasets
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig
    from transformers import AutoConfig

    from benchmarks.peer_saelens import buffer_plan  # one tiling rule, shared with the peer bench

    width = int(AutoConfig.from_pretrained(model_dir).hidden_size)
    n_ctx, ctx = tokens.shape
    batch = model_batch(n_ctx, batch)
    n_seq, gb = buffer_plan(n_ctx, batch, ctx, width * 4)
    assert n_seq == n_ctx
    hook = f"model.layers.{layer}"   # HF llama decoder block L: its output is resid_post.L
    out.mkdir(parents=True)
    np.save(out / "tokens.npy", tokens)
    cfg = CacheActivationsRunnerConfig(
        dataset_path=str(out / "tokens.npy"), model_name=model_dir,
        model_class_name="AutoModelForCausalLM", model_batch_size=batch, hook_name=hook,
        d_in=width, training_tokens=n_ctx * ctx, context_size=ctx,
        new_cached_activations_path=str(out / "cache"), shuffle=False, dtype="float32",
        device="cpu", buffer_size_gb=gb, prepend_bos=False,   # BOS is already in the tokens
        model_from_pretrained_kwargs={"dtype": model_dtype})
    ds = datasets.Dataset.from_dict({"input_ids": tokens.tolist()})
    cached = CacheActivationsRunner(cfg, override_dataset=ds).run()
    if len(cached) != n_ctx or not (cached.with_format("numpy")["token_ids"] == tokens).all():
        raise SystemExit("SAELens cached other tokens than the store's (order or count)")
    return hook


def load_saelens_cache(path: Path, tokens: np.ndarray, hook: str) -> np.ndarray:
    """[n_rows, width] float32, row i * C + j = context i, position j; token ids checked."""
    import datasets

    ds = datasets.load_from_disk(str(path / "cache")).with_format("numpy")
    if not (ds["token_ids"] == tokens).all():
        raise SystemExit(f"{path}: the cache holds other tokens than the store")
    x = np.asarray(ds[hook], dtype=np.float32)
    return x.reshape(-1, x.shape[-1])


def train_rows_pass(store, point, kw) -> tuple[ActivationDataset, np.ndarray]:
    """The train dataset (for its constants) and every train row id it keeps, in one pass."""
    ds = ActivationDataset(store, points=point, batch_size=8192, split="train", shuffle=False,
                           return_meta=True, **kw)
    rows = np.concatenate([b["row"].numpy() for b in ds])
    return ds, rows


def heldout(store, point, kw, constants) -> tuple[torch.Tensor, np.ndarray]:
    ds = ActivationDataset(store, points=point, batch_size=8192, split="test", shuffle=False,
                           return_meta=True, norm_constants=constants, **kw)
    out = list(ds)
    return torch.cat([b["acts"] for b in out]), np.concatenate([b["row"].numpy() for b in out])


def make_sae(args, d: int):
    from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig

    torch.manual_seed(args.seed)   # the same initial weights on both sides
    return TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d, d_sae=args.expansion * d, k=args.k,
                                                 device=args.device, normalize_activations="none"))


def train(args, sae, batches) -> list[float]:
    """SAELens's SAETrainer over an iterator of [batch, d]; returns the per-step losses."""
    from sae_lens import SAETrainer
    from sae_lens.config import SAETrainerConfig

    cfg = SAETrainerConfig(total_training_samples=args.steps * args.batch_size,
                           train_batch_size_samples=args.batch_size, lr=args.lr, lr_end=args.lr,
                           device=args.device, dead_feature_window=max(1, args.steps // 4),
                           feature_sampling_window=max(1, args.steps // 4))
    trainer = SAETrainer(cfg, sae, data_provider=batches)
    losses, step = [], trainer.step

    def recording_step(batch):   # SAETrainer.step is its public per-step seam
        out = step(batch)
        losses.append(out.loss.item())
        return out

    trainer.step = recording_step
    torch.manual_seed(args.seed)
    trainer.fit()
    sae.eval()
    return losses


@torch.no_grad()
def dead_fraction(sae, x: torch.Tensor) -> float:
    """Latents never active on any held-out row."""
    fired = torch.zeros(sae.cfg.d_sae, dtype=torch.bool)
    for i in range(0, x.shape[0], 4096):
        fired |= (sae.encode(x[i: i + 4096]) > 0).any(0)
    return float(1 - fired.float().mean())


def summary(losses: list[float]) -> dict:
    return {"first_loss": losses[0], "last_loss": float(np.mean(losses[-20:])),
            "steps": len(losses)}


def main():
    ap = parser(__doc__, steps=1000, batch=1024, lr=5e-4)
    ap.add_argument("--saelens-cache", required=True,
                    help="SAELens cache folder; built here by SAELens when it does not exist")
    ap.add_argument("--model", default=None, help="HF checkpoint (default: the store's model_path)")
    ap.add_argument("--model-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model-batch", type=int, default=16, help="contexts per SAELens forward")
    ap.add_argument("--test-fraction", type=float, default=0.05)
    args = ap.parse_args()
    t0 = time.perf_counter()
    store = open_store(args.store, read_only=True)
    point = args.point or store.points[len(store.points) // 2]
    if not point.startswith("resid_post."):
        raise SystemExit(f"--point {point}: only resid_post.L maps to a SAELens HF hook here")
    layer, d = int(point.split(".")[1]), store.width
    tokens = store_tokens(store)

    cache = Path(args.saelens_cache)
    hook = f"model.layers.{layer}"
    if not cache.exists():
        model = args.model or store.attrs.get("model_path")
        t = time.perf_counter()
        hook = build_saelens_cache(model, tokens, layer, cache, args.model_batch, args.model_dtype)
        print(f"[parity] SAELens cached {tokens.size} tokens in {time.perf_counter() - t:.1f}s")
    xs = load_saelens_cache(cache, tokens, hook)

    kw = recipe_kwargs(store, args.seed, args.test_fraction)
    train_ds, train_rows = train_rows_pass(store, point, kw)
    constants = train_ds.norm_constants
    # SAELens side: its own E||x||^2 over the same train rows (harvest's is the reader's sample)
    s_scale = float(np.sqrt(d / np.mean(np.einsum("ij,ij->i", xs[train_rows], xs[train_rows],
                                                  dtype=np.float64))))

    # harvest: the reader's shuffled stream, each batch's row ids recorded for the SAELens side
    stream = ActivationDataset(store, points=point, batch_size=args.batch_size, split="train",
                               steps=args.steps, seed=args.seed, return_meta=True,
                               norm_constants=constants, **kw)
    order: list[np.ndarray] = []

    def harvest_batches():
        for b in stream:
            order.append(b["row"].numpy())
            yield b["acts"].to(args.device, torch.float32)

    def saelens_batches():
        for rows in order:
            yield torch.from_numpy(xs[rows] * s_scale).to(args.device)

    sae_h, sae_s = make_sae(args, d), make_sae(args, d)
    t = time.perf_counter()
    loss_h = train(args, sae_h, harvest_batches())
    loss_s = train(args, sae_s, saelens_batches())
    train_s = time.perf_counter() - t

    xh_test, test_rows = heldout(store, point, kw, constants)
    xs_test = torch.from_numpy(xs[test_rows] * s_scale)
    fvu_h = heldout_fvu(lambda x: sae_h(x), [xh_test], args.device)
    fvu_s = heldout_fvu(lambda x: sae_s(x), [xs_test], args.device)
    # the two sources' rows, in activation units: bf16 vLLM vs fp32 HF
    raw_h = constants.invert(xh_test).double()
    rel = ((raw_h - xs_test.double() / s_scale).norm(dim=1) / raw_h.norm(dim=1)).numpy()
    report(trainer="sae-lens TopK x2", store=args.store, saelens_cache=str(cache), hook=hook,
           point=point, tokens=int(tokens.size), train_rows=int(train_rows.size),
           heldout_rows=int(test_rows.size), latents=args.expansion * d, k=args.k, lr=args.lr,
           batch_size=args.batch_size, seed=args.seed,
           harvest={"heldout_fvu": fvu_h, "dead_fraction": dead_fraction(sae_h, xh_test),
                    "norm_scale": float(constants.scale[0, 0]), **summary(loss_h)},
           saelens={"heldout_fvu": fvu_s, "dead_fraction": dead_fraction(sae_s, xs_test),
                    "norm_scale": s_scale, **summary(loss_s)},
           fvu_ratio=fvu_h / fvu_s,
           # each SAE on the other source's held-out rows: interchangeable SAEs score alike
           cross_fvu={"harvest_sae_on_saelens": heldout_fvu(lambda x: sae_h(x), [xs_test]),
                      "saelens_sae_on_harvest": heldout_fvu(lambda x: sae_s(x), [xh_test])},
           act_rel_err={"median": float(np.median(rel)), "p99": float(np.quantile(rel, 0.99))},
           train_seconds=train_s, seconds=time.perf_counter() - t0, repo=str(REPO))


if __name__ == "__main__":
    main()
