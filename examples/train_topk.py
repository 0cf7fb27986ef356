"""Train a TopK SAE in plain PyTorch on a harvest store; report held-out FVU.

    python examples/train_topk.py                       # the default run's store, middle layer
    python examples/train_topk.py --store s3://acts/run1 --point resid_post.12 --steps 20000

TopK SAE (Gao et al. 2024): latents = ReLU(TopK(W_enc (x - b_dec) + b_enc)), x_hat = W_dec
latents + b_dec, decoder rows kept at unit norm; loss = mean squared error on the normalised
rows (E||x||^2 = width, so MSE x width / E||x - mean||^2 is close to the FVU).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from common import datasets, parser, report

from harvest.store import heldout_fvu, on_device


class TopKSAE(nn.Module):
    def __init__(self, d: int, m: int, k: int):
        super().__init__()
        self.k = k
        w = torch.randn(m, d)
        w /= w.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(w)                       # [m, d], unit rows
        self.W_enc = nn.Parameter(w.t().clone())           # [d, m]
        self.b_enc = nn.Parameter(torch.zeros(m))
        self.b_dec = nn.Parameter(torch.zeros(d))

    def encode(self, x):
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        top = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())

    def forward(self, x):
        return self.encode(x) @ self.W_dec + self.b_dec

    @torch.no_grad()
    def normalize_decoder(self):
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True)


def main():
    args = parser(__doc__, steps=1000, batch=1024, lr=1e-3).parse_args()
    torch.manual_seed(args.seed)
    store, point, train, test = datasets(args)
    d = store.width
    sae = TopKSAE(d, args.expansion * d, args.k).to(args.device)
    opt = torch.optim.Adam(sae.parameters(), lr=args.lr)
    losses, t = [], time.perf_counter()
    for x in on_device(train, args.device):
        loss = ((sae(x) - x) ** 2).sum(-1).mean() / d
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sae.normalize_decoder()
        losses.append(loss.item())
    fvu = heldout_fvu(sae, test, args.device)
    report(trainer="torch-topk", store=args.store, point=point, steps=len(losses), batch_size=args.batch_size,
           latents=args.expansion * d, k=args.k, first_loss=losses[0], last_loss=sum(losses[-20:]) / 20,
           heldout_fvu=fvu, seconds=time.perf_counter() - t, norm_source=train.norm_constants.source)


if __name__ == "__main__":
    main()
