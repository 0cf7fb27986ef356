"""A DataLoader over an ActivationDataset that knows how many batches it delivered.

The dataset's batches come from worker processes round-robin; counting them here is what lets
`state_dict()` name the resume point without asking the workers: batches are numbered per rank,
and after a resume worker k produces the lane the round-robin will ask it for (sampling.lane).

With workers, batches come back through shared-memory slots (handoff.py), not torch's pickling:
a batch's tensor lives in a slot that is reused only once no tensor over it is alive.
"""

from __future__ import annotations

import torch

from . import handoff
from ..shuffle import mixing
from ...format.jsonattrs import JsonObject


class ActivationLoader(torch.utils.data.DataLoader):
    """torch DataLoader(batch_size=None) with `state_dict()` / `load_state_dict()`."""

    def __init__(self, dataset, num_workers: int = 0, **kwargs):
        if kwargs.pop("batch_size", None) is not None:
            raise ValueError("ActivationLoader: the dataset yields whole batches; leave batch_size unset")
        if num_workers > 1:
            dataset.count_rows()  # in the parent once, not in every worker
            mixing.check(dataset, num_workers)   # each worker's window lies within its part
        super().__init__(dataset, batch_size=None, num_workers=num_workers, **kwargs)
        self._base, self._delivered = 0, 0
        self.handoff: handoff.ParentSide | None = None
        cap = handoff.slot_bytes(dataset) if num_workers > 0 else None
        if cap and handoff.usable(kwargs.get("multiprocessing_context")):
            self.handoff = handoff.ParentSide(handoff.Rings(num_workers, cap))

    def __iter__(self):
        self._base, self._delivered = self.dataset.resume_point, 0
        if self.handoff is not None and not self.persistent_workers and self.handoff.rings.gen[0]:
            # new workers each iteration: new slots too, so workers of an iteration still alive
            # (a generator kept) never share a slot with the new ones
            self.handoff = handoff.ParentSide(handoff.Rings(self.num_workers, self.handoff.rings.cap))
        hand = self.handoff
        if hand is None:
            it = super().__iter__()
        else:
            hand.begin()
            self.dataset.handoff_rings = hand.rings   # inherited by the workers forked now
            try:
                it = super().__iter__()
            finally:
                self.dataset.handoff_rings = None     # a plain DataLoader's workers must not pack
            hand.started()
        pin = self.pin_memory and torch.cuda.is_available()   # as torch decides for its own batches
        for x in it:
            self._delivered += 1
            yield x if hand is None else hand.unpack(x, pin)

    def state_dict(self) -> JsonObject:
        return self.dataset.state_dict(self._base + self._delivered, self.num_workers)

    def load_state_dict(self, state: dict) -> None:
        if int(state.get("num_workers", 0)) != self.num_workers:
            raise ValueError(f"reader state was saved with num_workers={state.get('num_workers')}, this "
                             f"loader has {self.num_workers}: rows are split over workers, so resume "
                             "with the same number")
        self.dataset.load_state_dict(state)
