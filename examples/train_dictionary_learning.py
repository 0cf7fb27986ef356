"""Train a dictionary_learning TopK SAE from a harvest store: `trainSAE(data=...)`.

    .venv-trainers/bin/python examples/train_dictionary_learning.py --store <url> --steps 20000

dictionary_learning (0.1) reads `data` until `steps` batches; its TopKTrainer wants `layer` and
`lm_name` only as labels, taken here from the store's attributes. trainSAE returns nothing, so
the final SAE is read back from `save_dir`. Needs dictionary-learning in the environment (bash
.ci/install builds .venv-trainers with it; its install replaces torch, so not in the engine's venv).
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from common import datasets, parser, report
from dictionary_learning.trainers.top_k import AutoEncoderTopK, TopKTrainer
from dictionary_learning.training import trainSAE

from harvest.store import dictionary_learning_data, heldout_fvu


def main():
    args = parser(__doc__, steps=1000, batch=1024, lr=5e-4).parse_args()
    torch.manual_seed(args.seed)
    store, point, train, test = datasets(args)
    d, m = store.width, args.expansion * store.width
    model = (store.attrs.get("model") or {}).get("model") or store.attrs.get("model_path") or "unknown"
    save_dir = tempfile.mkdtemp(prefix="dl-sae-")
    cfg = {"trainer": TopKTrainer, "steps": args.steps, "activation_dim": d, "dict_size": m, "k": args.k,
           "layer": int(point.rsplit(".", 1)[-1]), "lm_name": str(model), "lr": args.lr,
           "warmup_steps": max(1, args.steps // 20), "threshold_start_step": args.steps // 2,
           "device": args.device, "seed": args.seed}
    t = time.perf_counter()
    trainSAE(data=dictionary_learning_data(train, args.device, args.steps), trainer_configs=[cfg],
             steps=args.steps, save_dir=save_dir, device=args.device)
    ae = AutoEncoderTopK(d, m, args.k)
    ae.load_state_dict(torch.load(os.path.join(save_dir, "trainer_0", "ae.pt")))
    ae.to(args.device).eval()
    fvu = heldout_fvu(lambda x: ae(x), test, args.device)
    report(trainer="dictionary-learning", point=point, steps=args.steps, batch_size=args.batch_size, latents=m,
           k=args.k, heldout_fvu=fvu, seconds=time.perf_counter() - t, norm_source=train.norm_constants.source)


if __name__ == "__main__":
    main()
