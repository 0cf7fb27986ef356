"""What each SAE trainer's entry point takes, made from an ActivationDataset (or its loader).

- SAELens 6.x: `SAETrainer(cfg, sae, data_provider=saelens_data_provider(ds))`: an *iterator*
  (the trainer calls next() once per step until `total_training_samples`), [batch, d_in].
- dictionary_learning 0.1: `trainSAE(data=dictionary_learning_data(ds), steps=..., ...)`: any
  iterable of [batch, d] that lasts `steps` batches.
- sparsify 1.3 trains online from a Hugging Face model only; drive its `SparseCoder` with your
  own loop over `on_device(ds)` (examples/train_sparsify.py).
- plain PyTorch: `on_device(ds)` (examples/train_topk.py).
- crosscoders, over a paired dataset (`ActivationDataset([store_a, store_b], point)`):
  `crosscoder_data(ds)` gives `[batch, n_models, width]`, what a crosscoder trainer takes
  (dictionary_learning's `CrossCoderTrainer`, in the jkminder fork that adds it: PyPI's
  dictionary-learning 0.1.0, the only release, has none; SAELens 6.54 and sparsify 1.3 have no
  crosscoder mode either). `crosscoder_data(ds, flatten=True)` gives `[batch, n_models * width]`
  for any SAE trainer: an SAE over the concatenated rows is an acausal crosscoder whose decoder
  rows split per model (`[dict_size, n_models * width]` viewed as `[dict_size, n_models,
  width]`), trained with the SAE's
  penalty on the whole decoder row (examples/train_crosscoder.py, dictionary_learning's TopK).

Transcoders read one point and predict another, row for row (mlp_in.L -> mlp_out.L); the
dataset reads both in one batch (`points=["mlp_in.3", "mlp_out.3"]`) and `transcoder_batches`
splits each batch into (x, y):
- sparsify 1.3: `SparseCoder(d, TranscoderConfig(...))`, `sae(x, y)` per batch
  (examples/train_transcoder_sparsify.py); its decoder is `d_in` wide, so x and y have one width.
- a cross-layer transcoder's inputs: x = mlp_in at every layer, y = mlp_out at every layer
  (`[batch, layers, d]` each); none of the three trainers ships one, so any CLT module takes
  these as they are.
- SAELens 6.x trains no transcoder (its `Transcoder` is an inference class); its
  `MultiSAETrainer` trains SAEs on several hooks of different widths in lockstep from one
  `dict[hook, [batch, d_hook]]` stream: `saelens_multi_data_provider(ds)`.
- dictionary_learning 0.1 has no transcoder trainer (`trainSAE(transcoder=True)` changes only
  its logging; every trainer's loss reconstructs its input).

The dataset must yield one point (`points="resid_post.N"`, 2-D batches) and, for trainers that
count steps themselves, run long enough: `steps=N` (or `endless=True`) instead of one epoch,
checked here so a trainer does not stop with a bare StopIteration mid-run.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .dataset import ActivationDataset
from .paired import PairedDataset


def _dataset(source) -> ActivationDataset | None:
    if isinstance(source, ActivationDataset):
        return source
    ds = getattr(source, "dataset", None)
    return ds if isinstance(ds, ActivationDataset) else None


def _check(source, steps: int | None, who: str) -> None:
    if isinstance(source, PairedDataset) or isinstance(getattr(source, "dataset", None), PairedDataset):
        raise ValueError(f"{who}: a paired dataset yields [batch, n_models, width]; train a "
                         "crosscoder on crosscoder_data(ds), or flatten=True for an SAE trainer")
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


def crosscoder_data(source: Iterable, device="cpu", steps: int | None = None,
                    flatten: bool = False) -> Iterator[torch.Tensor]:
    """A crosscoder's data from a paired dataset (or its loader): float32 `[batch, n_models,
    width]` on `device`, or `[batch, n_models * width]` with `flatten` (model 0's width
    first). Checked: one point per store, stacked (form="stack"), lasting `steps` batches."""
    ds = source if isinstance(source, PairedDataset) else getattr(source, "dataset", None)
    if isinstance(ds, PairedDataset):
        if ds.form != "stack" or any(len(p) != 1 for p in ds.points) or ds.datasets[0].stack:
            raise ValueError(f"crosscoder_data: the paired dataset yields {ds.form} batches of points "
                             f"{ds.points}; read one point per store (points='resid_post.N', or "
                             "store_points=[one point each]) with form='stack'")
        if steps is not None and not ds.endless:
            per_epoch = ds.rows_per_worker() // ds.batch_size
            if per_epoch < steps:
                raise ValueError(f"crosscoder_data: {steps} steps need more than one epoch ({per_epoch} "
                                 f"batches); build the dataset with steps={steps} (or endless=True)")
    elif _dataset(source) is not None:
        raise ValueError("crosscoder_data: give a paired dataset, ActivationDataset([store_a, "
                         "store_b], point): one store has no models to cross")
    for x in on_device(source, device):
        if x.dim() != 3:
            raise ValueError(f"crosscoder_data: batches must be [batch, n_models, width], got {tuple(x.shape)}")
        yield x.reshape(x.shape[0], -1) if flatten else x

def _points(batch, names: list[str]) -> "dict[str, torch.Tensor]":
    """{point: [batch, width_p]} from one dataset batch: a dict (points of several widths), a
    stacked `[batch, n_points, width]` tensor (in the dataset's point order) or return_meta's."""
    acts = batch["acts"] if isinstance(batch, dict) and "acts" in batch else batch
    if isinstance(acts, dict):
        return acts
    if acts.dim() == 2:
        return {names[0]: acts}
    return {p: acts[:, i] for i, p in enumerate(names)}


def transcoder_batches(source: Iterable, inputs, targets, device="cpu",
                       dtype: torch.dtype = torch.float32, steps: int | None = None
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) per batch for a transcoder: `inputs` and `targets` are a point each (`"mlp_in.3"`,
    `"mlp_out.3"`: x, y are `[batch, width]`) or lists of points of one width each (a
    cross-layer transcoder: `[batch, len(points), width]`). The dataset reads them all, row
    aligned (x[i] and y[i] are the same token)."""
    ds = _dataset(source)
    ins = [inputs] if isinstance(inputs, str) else list(inputs)
    outs = [targets] if isinstance(targets, str) else list(targets)
    if ds is not None:
        missing = [p for p in ins + outs if p not in ds.points]
        if missing:
            raise ValueError(f"transcoder_batches: the dataset does not read {missing}; build it "
                             f"with points={ins + [p for p in outs if p not in ins]}")
        if steps is not None and not ds.endless and ds.rows_per_worker() // ds.batch_size < steps:
            raise ValueError(f"transcoder_batches: {steps} steps need more than one epoch; build "
                             f"the dataset with steps={steps} (or endless=True)")
    names = list(ds.points) if ds is not None else ins + outs
    dev = torch.device(device)

    def take(acts: dict, which: list[str], one: bool) -> torch.Tensor:
        t = acts[which[0]] if one else torch.stack([acts[p] for p in which], dim=1)
        return t.to(dev, dtype, non_blocking=dev.type == "cuda")

    for b in source:
        acts = _points(b, names)
        yield take(acts, ins, isinstance(inputs, str)), take(acts, outs, isinstance(targets, str))


def saelens_multi_data_provider(source: Iterable, hook_names: "dict[str, str] | None" = None,
                                device="cpu", steps: int | None = None
                                ) -> Iterator[dict[str, torch.Tensor]]:
    """SAELens' MultiHookDataProvider: an iterator of `{hook_name: [batch, d_hook]}` float32
    batches, rows aligned across hooks, each at its own width (e.g. mlp_in.3 and mlp_act.3).
    `hook_names`: point -> the hook name the trainer knows it by (default: the point's name)."""
    ds = _dataset(source)
    if ds is not None and steps is not None and not ds.endless \
            and ds.rows_per_worker() // ds.batch_size < steps:
        raise ValueError(f"saelens_multi_data_provider: {steps} steps need more than one epoch; "
                         f"build the dataset with steps={steps} (or endless=True)")
    names = list(ds.points) if ds is not None else list(hook_names or {})
    rename = hook_names or {}
    dev = torch.device(device)
    for b in source:
        yield {rename.get(p, p): t.to(dev, torch.float32, non_blocking=dev.type == "cuda")
               for p, t in _points(b, names).items()}


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
