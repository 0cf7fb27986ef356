"""Train a sparsify (EleutherAI) SparseCoder from a harvest store with your own loop.

    .venv-trainers/bin/python examples/train_sparsify.py --store <url> --steps 20000

sparsify 1.3's Trainer captures activations online from a Hugging Face model; its SparseCoder
and losses are plain modules, so this loop feeds it stored rows: loss = fvu + auxk_alpha x
auxk_loss (its own loss terms), decoder kept at unit norm as its trainer does.
"""

from __future__ import annotations

import time

import torch
from common import datasets, parser, report
from sparsify import SparseCoder, SparseCoderConfig

from harvest.store import heldout_fvu, on_device


def main():
    args = parser(__doc__, steps=1000, batch=1024, lr=5e-4).parse_args()
    torch.manual_seed(args.seed)
    store, point, train, test = datasets(args)
    d = store.width
    sae = SparseCoder(d, SparseCoderConfig(expansion_factor=args.expansion, k=args.k), device=args.device)
    opt = torch.optim.Adam(sae.parameters(), lr=args.lr)
    fired = torch.zeros(sae.num_latents, dtype=torch.long, device=args.device)
    losses, t = [], time.perf_counter()
    for x in on_device(train, args.device):
        out = sae(x, dead_mask=fired > 100)
        loss = out.fvu + out.auxk_loss / 32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sae.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        sae.set_decoder_norm_to_unit_norm()
        fired += 1
        fired[out.latent_indices.flatten()] = 0
        losses.append(out.fvu.item())
    sae.eval()
    fvu = heldout_fvu(lambda x: sae(x).sae_out, test, args.device)
    report(trainer="sparsify", point=point, steps=len(losses), batch_size=args.batch_size,
           latents=sae.num_latents, k=args.k, first_loss=losses[0], last_loss=sum(losses[-20:]) / 20,
           heldout_fvu=fvu, seconds=time.perf_counter() - t, norm_source=train.norm_constants.source)


if __name__ == "__main__":
    main()
