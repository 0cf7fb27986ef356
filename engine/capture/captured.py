"""The unit a capture yields: one request's prompt rows at every requested point, and
`run_with_cache`, which collects them into per-request caches."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..addresses import Address
from ..points import LOGIT_POINTS, PACKED
from .packed import unpack


class ActivationCache(dict):
    """`{Address: [n, width]}` that also answers string keys: `cache["resid_post.3"]`.

    Keys stay `Address` objects (iteration, `keys()`), so code written against them keeps working;
    a string is parsed on lookup, as TransformerLens users write it, instead of a KeyError.
    """

    @staticmethod
    def _key(k):
        return k if isinstance(k, Address) else Address.parse(k)

    def __getitem__(self, k):
        return super().__getitem__(self._key(k))

    def __contains__(self, k) -> bool:
        try:
            return super().__contains__(self._key(k))
        except (TypeError, ValueError):
            return False

    def get(self, k, default=None):
        return super().get(self._key(k), default)


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
    # each point's own width where points of several widths share `acts` (its last dim is the
    # widest; a narrower point's columns past its width are not data); None: all `acts` wide
    widths: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def point(self, addr: "Address | str") -> torch.Tensor:
        """`[n, width of that point]`: z is n_heads x head_dim wide, mlp_act the MLP's width;
        logprob.0 and entropy.0 are float32 `[n]` (engine/capture/scores.py); expert_indices
        int32 and expert_weights float32 `[n, k]` (engine/capture/packed.py)."""
        a = Address.parse(addr)
        i = self.points.index(a)
        rows = self.acts[i] if self.widths is None else self.acts[i, :, : self.widths[i]]
        if a.name not in PACKED:
            return rows
        values = unpack(rows, PACKED[a.name])
        return values.reshape(-1) if a.name in LOGIT_POINTS else values

    def as_dict(self) -> ActivationCache:
        """`{Address: [n, width]}` at each point's own width; string keys work too
        (`d["resid_post.3"]`)."""
        return ActivationCache((a, self.point(a)) for a in self.points)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Host tensor -> numpy without changing bits; bf16 becomes ml_dtypes.bfloat16."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def run_with_cache(model, tokens, points=None) -> list[ActivationCache]:
    """Capture a list of token lists; results in submission order, one {Address: [n, width]} each
    (string keys work too: `caches[0]["resid_post.3"]`)."""
    out: list = [None] * len(tokens)
    for req in model.capture([tokens], points):
        out[req.index] = req.as_dict()
    return out
