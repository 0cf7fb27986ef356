"""What each SAE trainer's entry point takes, made from an ActivationDataset (or its loader).

- SAELens 6.x: `SAETrainer(cfg, sae, data_provider=saelens_data_provider(ds))`: an *iterator*
  (the trainer calls next() once per step until `total_training_samples`), [batch, d_in].
- dictionary_learning 0.1: `trainSAE(data=dictionary_learning_data(ds), steps=..., ...)`: any
  iterable of [batch, d] that lasts `steps` batches.
- sparsify 1.3 trains online from a Hugging Face model only; drive its `SparseCoder` with your
  own loop over `on_device(ds)` (examples/train_sparsify.py).
- plain PyTorch: `on_device(ds)` (examples/train_topk.py).

The dataset must yield one point (`points="resid_post.N"`, 2-D batches) and, for trainers that
count steps themselves, run long enough: `steps=N` (or `endless=True`) instead of one epoch,
checked here so a trainer does not stop with a bare StopIteration mid-run.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .dataset import ActivationDataset


def _dataset(source) -> ActivationDataset | None:
    if isinstance(source, ActivationDataset):
        return source
    ds = getattr(source, "dataset", None)
    return ds if isinstance(ds, ActivationDataset) else None


def _check(source, steps: int | None, who: str) -> None:
    ds = _dataset(source)
    if ds is None:
        return
    if ds.stack:
        raise ValueError(f"{who}: the dataset yields [batch, n_points, width]; give one point "
                         f"(points='{ds.points[0]}') so batches are [batch, width]")
    if steps is not None and not ds.endless and not ds.follow:   # a follower's length is the run's
        per_epoch = ds.rows_per_worker() // ds.batch_size
        if per_epoch < steps:
            raise ValueError(f"{who}: {steps} steps need more than one epoch ({per_epoch} batches); build "
                             f"the dataset with steps={steps} (or endless=True)")


def on_device(source: Iterable, device="cpu", dtype: torch.dtype = torch.float32) -> Iterator[torch.Tensor]:
    """[batch, d] tensors on `device` in `dtype` (the `acts` of return_meta batches)."""
    dev = torch.device(device)
    for b in source:
        x = b["acts"] if isinstance(b, dict) else b
        yield x.to(dev, dtype, non_blocking=dev.type == "cuda")


def saelens_data_provider(source: Iterable, device="cpu", steps: int | None = None) -> Iterator[torch.Tensor]:
    """SAELens' DataProvider: an iterator of [batch, d_in] float32 batches.

    Pass `normalize="norm_scale"` to the dataset and `normalize_activations="none"` to the SAE
    config: the reader's constants describe exactly the rows it yields (SAELens' own estimate
    reads `n_batches_for_norm_estimate` batches from the same iterator first).
    """
    _check(source, steps, "saelens_data_provider")
    return on_device(source, device)


def dictionary_learning_data(source: Iterable, device="cpu", steps: int | None = None) -> Iterator[torch.Tensor]:
    """dictionary_learning's `data`: an iterable of [batch, d] batches lasting `steps` batches."""
    _check(source, steps, "dictionary_learning_data")
    return on_device(source, device)


@torch.no_grad()
def heldout_fvu(reconstruct, heldout: Iterable, device="cpu", max_batches: int | None = None) -> float:
    """Fraction of variance unexplained on held-out rows: sum ||x - f(x)||^2 / sum ||x - mean||^2.

    `reconstruct` maps [batch, d] -> [batch, d]; `heldout` is typically the dataset with
    split="test" and the train split's `norm_constants`, shuffle=False.
    """
    err = n = 0.0
    s1 = s2 = None
    for i, x in enumerate(on_device(heldout, device)):
        if max_batches is not None and i >= max_batches:
            break
        x = x.double()
        err += float(((x - reconstruct(x.float()).double()) ** 2).sum())
        s1 = x.sum(0) if s1 is None else s1 + x.sum(0)
        s2 = (x * x).sum(0) if s2 is None else s2 + (x * x).sum(0)
        n += x.shape[0]
    if not n:
        raise ValueError("heldout_fvu: the held-out set is empty (raise test_fraction?)")
    total = float((s2 - s1 * s1 / n).sum())
    return err / total
