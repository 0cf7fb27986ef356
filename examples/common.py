"""Shared by the examples: the default store, the training recipe, the held-out split, results.

The recipe (what the reader's defaults leave to the trainer): one point; special tokens out
(the store's recorded ids, or context position 0 where every context starts with BOS and the
store predates recorded ids); rows over 10x the median norm out (attention sinks); E||x||^2 =
width; 5 % of the documents held out, normalised with the train split's constants.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path and not os.environ.get("HARVEST_LIGHT"):
    sys.path.insert(0, str(REPO))   # run from a checkout; with the light package installed, not needed

from harvest.store import ActivationDataset, open_store


def default_store() -> str:
    cache = Path(os.environ.get("HARVEST_CACHE", REPO / ".harvest"))
    return str(cache / "stores" / "default")


def parser(doc: str, steps: int, batch: int, lr: float) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--store", default=default_store(),
                    help="store URL (default: the default run's, made by `harvest run --config "
                         "jobs/configs/default.yaml`)")
    ap.add_argument("--point", default=None, help="point to train on (default: the middle layer)")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch-size", type=int, default=batch)
    ap.add_argument("--expansion", type=int, default=4, help="latents = expansion x width")
    ap.add_argument("--k", type=int, default=32, help="active latents per row (TopK)")
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def recipe_kwargs(store, seed: int, test_fraction: float = 0.05) -> dict:
    """The recipe's ActivationDataset arguments (all but points, batch and split)."""
    kw = dict(max_norm_ratio=10.0, normalize="norm_scale", split_seed=seed,
              test_fraction=test_fraction)
    packing = (store.attrs.get("config") or {}).get("packing") or {}
    # The special ids are a format attribute (`harvest.special_token_ids`, what
    # `store.special_token_ids` reads); the run attributes keep them under `tokenizer`, never at
    # the top level, so reading `attrs["special_token_ids"]` missed every pipeline store and the
    # recipe trained on attention-sink BOS rows (|x|^2 ~ 1e4 x the median).
    # exclude_special=True also drops the attention-sink positions 0 and 1 (the store's kept
    # rows); a store without special ids drops them by position
    if store.special_token_ids:
        kw["exclude_special"] = True
    elif packing.get("bos", "context") == "context":
        kw["seqpos"] = slice(2, None)
    return kw


def datasets(args):
    """(train: endless for args.steps batches, test: one ordered pass), same constants."""
    store = open_store(args.store, read_only=True)
    point = args.point or store.points[len(store.points) // 2]
    kw = dict(points=point, **recipe_kwargs(store, args.seed))
    train = ActivationDataset(store, batch_size=args.batch_size, split="train", steps=args.steps,
                              seed=args.seed, **kw)
    test = ActivationDataset(store, batch_size=4096, split="test", shuffle=False,
                             norm_constants=train.norm_constants, **kw)
    return store, point, train, test


def report(**fields) -> None:
    """One machine-readable line for the tests and for copying into a README."""
    print("RESULT " + json.dumps(fields), flush=True)
