"""Train SAELens SAEs on points of different widths in lockstep: `MultiSAETrainer`.

    .venv-trainers/bin/python examples/train_saelens_multi.py --store <url> --points mlp_in.3 mlp_act.3

The reader yields every point of a batch row aligned, each at its own width (a dict
`{point: [batch, width]}` when widths differ: mlp_act is the MLP's width, mlp_in the model's);
`saelens_multi_data_provider` is SAELens' MultiHookDataProvider, one TopK SAE per point.
Rows are normalised by the reader (E||x||^2 = the point's width), so each SAE is built with
normalize_activations="none".
"""

from __future__ import annotations

import time

import torch
from common import parser, recipe_kwargs, report
from sae_lens import TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.config import SAETrainerConfig
from sae_lens.training.multi_sae_trainer import MultiSAETrainer

from harvest.store import ActivationDataset, open_store, saelens_multi_data_provider


def main():
    ap = parser(__doc__, steps=1000, batch=1024, lr=5e-4)
    ap.add_argument("--points", nargs="+", default=None, help="default: every point of the store")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    store = open_store(args.store, read_only=True)
    points = args.points or list(store.points)
    kw = dict(points=points, **recipe_kwargs(store, args.seed))
    train = ActivationDataset(store, batch_size=args.batch_size, split="train", steps=args.steps,
                              seed=args.seed, **kw)
    test = ActivationDataset(store, batch_size=4096, split="test", shuffle=False,
                             norm_constants=train.norm_constants, **kw)
    saes = {p: TopKTrainingSAE(TopKTrainingSAEConfig(
        d_in=store.widths[p], d_sae=args.expansion * store.widths[p], k=args.k, device=args.device,
        normalize_activations="none")) for p in points}
    cfg = SAETrainerConfig(total_training_samples=args.steps * args.batch_size,
                           train_batch_size_samples=args.batch_size, lr=args.lr, lr_end=args.lr,
                           device=args.device, dead_feature_window=max(1, args.steps // 4),
                           feature_sampling_window=max(1, args.steps // 4))
    trainer = MultiSAETrainer(cfg, saes, {p: p for p in points},
                              saelens_multi_data_provider(train, device=args.device, steps=args.steps))
    losses: dict[str, list] = {p: [] for p in points}
    for p, tr in trainer.trainers.items():   # SAETrainer.step: the per-step seam, keep losses
        def recording(batch, _step=tr.step, _p=p):
            out = _step(batch)
            losses[_p].append(out.loss.item())
            return out
        tr.step = recording
    t = time.perf_counter()
    trainer.fit()
    fvu = {}
    with torch.no_grad():   # held-out FVU per point, each at its own width
        err = {p: 0.0 for p in points}
        s1: dict = {}
        s2: dict = {}
        n = 0
        for b in saelens_multi_data_provider(test, device=args.device):
            for p, x in b.items():
                x = x.double()
                err[p] += float(((x - saes[p].eval()(x.float()).double()) ** 2).sum())
                s1[p] = x.sum(0) + s1.get(p, 0)
                s2[p] = (x * x).sum(0) + s2.get(p, 0)
            n += next(iter(b.values())).shape[0]
        for p in points:
            fvu[p] = err[p] / float((s2[p] - s1[p] * s1[p] / n).sum())
    report(trainer="sae-lens-multi", points=points, widths={p: store.widths[p] for p in points},
           steps=len(losses[points[0]]), batch_size=args.batch_size,
           first_loss={p: v[0] for p, v in losses.items()},
           last_loss={p: sum(v[-20:]) / 20 for p, v in losses.items()}, heldout_fvu=fvu,
           seconds=time.perf_counter() - t, norm_source=train.norm_constants.source)


if __name__ == "__main__":
    main()
