"""Train a crosscoder on row-aligned stores (checkpoints, or a base model and its fine-tune).

    .venv-trainers/bin/python examples/train_crosscoder.py --store <base url> --with-store <tuned url>

The paired reader (`ActivationDataset([store_a, store_b], point)`) yields the same token's rows
from each store, `[batch, n_models, width]`, after checking from the commit markers that the
stores hold the same tokens. No installed trainer has a crosscoder mode (PyPI's
dictionary-learning 0.1.0 has no CrossCoder: that lives in a fork installed from git; SAELens 6.54
and sparsify 1.3 have none), so this trains dictionary_learning's TopK SAE on the concatenated
rows (`crosscoder_data(..., flatten=True)`, `[batch, n_models * width]`): an acausal crosscoder
whose decoder row j splits into one vector per model (`W_dec.T.view(dict, n_models, width)`).
It reports the held-out FVU over both models and per model, and how many latents have over 90 %
of their decoder norm in one model (the model-diffing figure: latents specific to one model).

Attention sinks are dropped by position here (`seqpos`), not by norm: a row's norm differs per
model, so the paired reader refuses `max_norm_ratio`.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from common import parser, recipe_kwargs, report
from dictionary_learning.trainers.top_k import AutoEncoderTopK, TopKTrainer
from dictionary_learning.training import trainSAE

from harvest.store import ActivationDataset, crosscoder_data, open_store


@torch.no_grad()
def fvu_per_model(ae, test, n_models: int, device) -> tuple[float, list[float]]:
    """FVU of the concatenated rows and of each model's part (sum of squared errors over the
    summed variance around each part's mean)."""
    err = torch.zeros(n_models, dtype=torch.float64)
    s1 = s2 = None
    n = 0
    for x in crosscoder_data(test, device):
        rec = ae(x.reshape(x.shape[0], -1)).reshape(x.shape).double()
        x = x.double()
        err += ((x - rec) ** 2).sum((0, 2)).cpu()
        s1 = x.sum(0) if s1 is None else s1 + x.sum(0)
        s2 = (x * x).sum(0) if s2 is None else s2 + (x * x).sum(0)
        n += x.shape[0]
    var = (s2 - s1 * s1 / n).sum(1).cpu()
    return float(err.sum() / var.sum()), [float(v) for v in err / var]


def main():
    ap = parser(__doc__, steps=1000, batch=1024, lr=5e-4)
    ap.add_argument("--with-store", action="append", required=True,
                    help="another store row-aligned with --store (repeat for more models)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    urls = [args.store, *args.with_store]
    first = open_store(urls[0], read_only=True)
    point = args.point or first.points[len(first.points) // 2]
    kw = recipe_kwargs(first, args.seed)
    kw.pop("max_norm_ratio")
    kw["seqpos"] = slice(2, None)   # the first two context positions: attention sinks
    train = ActivationDataset(urls, point, batch_size=args.batch_size, split="train",
                              steps=args.steps, seed=args.seed, **kw)
    test = ActivationDataset(urls, point, batch_size=4096, split="test", shuffle=False,
                             norm_constants=train.norm_constants, **kw)
    n_models, width = train.n_models, train.width
    d, m = n_models * width, args.expansion * width
    save_dir = tempfile.mkdtemp(prefix="dl-crosscoder-")
    cfg = {"trainer": TopKTrainer, "steps": args.steps, "activation_dim": d, "dict_size": m, "k": args.k,
           "layer": int(point.rsplit(".", 1)[-1]), "lm_name": "+".join(train.names), "lr": args.lr,
           "warmup_steps": max(1, args.steps // 20), "threshold_start_step": args.steps // 2,
           "device": args.device, "seed": args.seed}
    t = time.perf_counter()
    trainSAE(data=crosscoder_data(train, args.device, args.steps, flatten=True), trainer_configs=[cfg],
             steps=args.steps, save_dir=save_dir, device=args.device)
    ae = AutoEncoderTopK(d, m, args.k)
    ae.load_state_dict(torch.load(os.path.join(save_dir, "trainer_0", "ae.pt")))
    ae.to(args.device).eval()
    fvu, per_model = fvu_per_model(ae, test, n_models, args.device)
    dec = ae.decoder.weight.detach().T.reshape(m, n_models, width).norm(dim=2)   # [latent, model]
    share0 = (dec[:, 0] / dec.sum(1).clamp_min(1e-12)).cpu()
    report(trainer="dictionary-learning-topk-crosscoder", stores=train.names, point=point,
           steps=args.steps, batch_size=args.batch_size, latents=m, k=args.k, heldout_fvu=fvu,
           heldout_fvu_per_model=per_model,
           latents_mostly_model0=int((share0 > 0.9).sum()), latents_mostly_model1=int((share0 < 0.1).sum()),
           seconds=time.perf_counter() - t, norm_source=[c.source for c in train.norm_constants])


if __name__ == "__main__":
    main()
