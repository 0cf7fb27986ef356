"""The unit a capture yields: one request's prompt rows at every requested point."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .addresses import Address


@dataclass
class CapturedRequest:
    """Rows of one finished request, aligned row for row with `token_ids` and `positions`.

    `acts` is one contiguous host tensor `[n_points, n_tokens, width]` in the engine dtype, so a
    writer can hand `acts[p]` to a store without another gather. `index` is the request's place in
    the order the caller submitted token lists (0, 1, 2, ... across all batches).
    """

    index: int
    token_ids: np.ndarray  # int32 [n]
    positions: np.ndarray  # int32 [n]
    points: tuple[Address, ...]
    acts: torch.Tensor  # [n_points, n, width], CPU

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def point(self, addr: "Address | str") -> torch.Tensor:
        return self.acts[self.points.index(Address.parse(addr))]

    def as_dict(self) -> dict[Address, torch.Tensor]:
        return {a: self.acts[i] for i, a in enumerate(self.points)}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Host tensor -> numpy without changing bits; bf16 becomes ml_dtypes.bfloat16."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
