"""Train a sparsify (EleutherAI) transcoder from a harvest store: mlp_in.L -> mlp_out.L.

    .venv-trainers/bin/python examples/train_transcoder_sparsify.py --store <url> --layer 3

A transcoder reads the MLP's input and predicts its output, row for row. The reader yields both
points in one batch (row i of each is the same token) and `transcoder_batches` splits a batch
into (x, y); sparsify's `SparseCoder` with `TranscoderConfig` takes them as `sae(x, y)`: loss =
fvu of y + auxk_alpha x auxk_loss, its own terms (its trainer leaves a transcoder's decoder
unnormalised, and so does this loop).
"""

from __future__ import annotations

import time

import torch
from common import parser, recipe_kwargs, report
from sparsify import SparseCoder, TranscoderConfig

from harvest.store import ActivationDataset, open_store, transcoder_batches


def main():
    ap = parser(__doc__, steps=1000, batch=1024, lr=5e-4)
    ap.add_argument("--layer", type=int, default=None, help="default: the store's first mlp_in")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    store = open_store(args.store, read_only=True)
    layer = args.layer if args.layer is not None else \
        int(next(p for p in store.points if p.startswith("mlp_in.")).rpartition(".")[2])
    xp, yp = f"mlp_in.{layer}", f"mlp_out.{layer}"
    kw = dict(points=[xp, yp], **recipe_kwargs(store, args.seed))
    train = ActivationDataset(store, batch_size=args.batch_size, split="train", steps=args.steps,
                              seed=args.seed, **kw)
    test = ActivationDataset(store, batch_size=4096, split="test", shuffle=False,
                             norm_constants=train.norm_constants, **kw)
    sae = SparseCoder(store.widths[xp], TranscoderConfig(expansion_factor=args.expansion, k=args.k),
                      device=args.device)
    opt = torch.optim.Adam(sae.parameters(), lr=args.lr)
    fired = torch.zeros(sae.num_latents, dtype=torch.long, device=args.device)
    losses, t = [], time.perf_counter()
    for x, y in transcoder_batches(train, xp, yp, args.device, steps=args.steps):
        out = sae(x, y, dead_mask=fired > 100)
        loss = out.fvu + out.auxk_loss / 32
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        fired += 1
        fired[out.latent_indices.flatten()] = 0
        losses.append(out.fvu.item())
    sae.eval()
    err = tot = 0.0
    s1 = s2 = None
    n = 0
    with torch.no_grad():   # held-out FVU of the prediction y_hat = sae(x) against y
        for x, y in transcoder_batches(test, xp, yp, args.device):
            y = y.double()
            err += float(((y - sae(x).sae_out.double()) ** 2).sum())
            s1 = y.sum(0) if s1 is None else s1 + y.sum(0)
            s2 = (y * y).sum(0) if s2 is None else s2 + (y * y).sum(0)
            n += y.shape[0]
    tot = float((s2 - s1 * s1 / n).sum())
    report(trainer="sparsify-transcoder", point=f"{xp}->{yp}", steps=len(losses),
           batch_size=args.batch_size, latents=sae.num_latents, k=args.k, first_loss=losses[0],
           last_loss=sum(losses[-20:]) / 20, heldout_fvu=err / tot, heldout_rows=n,
           seconds=time.perf_counter() - t, norm_source=train.norm_constants.source)


if __name__ == "__main__":
    main()
