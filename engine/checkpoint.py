"""What both backends need to know about a checkpoint before loading it, and input checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ModelInfo:
    n_layers: int
    width: int
    max_position: int
    vocab_size: int
    n_streams: int
    architecture: str
    kinds: tuple = ()  # ((width kind, width), ...) of engine/points.py, from the config

    def point_width(self, name: str) -> int:
        """The full (unsharded) width of point `name` in this model; ValueError if it has none."""
        from .points import BY_NAME

        kind = BY_NAME[name].width if name in BY_NAME else "d_model"
        w = self.width if kind == "d_model" else dict(self.kinds).get(kind)
        if not w:
            moe = name in BY_NAME and BY_NAME[name].moe
            raise ValueError(f"point {name!r} ({kind} wide) does not exist in this model: its "
                             f"config gives no {kind} width"
                             + (f" ({name} needs a MoE model; this one is dense)" if moe else ""))
        return int(w)

    def row_width(self, name: str, dtype) -> int:
        """Point `name`'s width in elements of the engine dtype: its values times
        engine/points.values_per_slot (a 32-bit value is two bfloat16 columns)."""
        from .points import values_per_slot

        return self.point_width(name) * values_per_slot(name, dtype)


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def read_model_info(name_or_path: str, revision: str | None = None) -> ModelInfo:
    """Read the config the same way for a hub name and a local path (from_pretrained)."""
    from transformers import AutoConfig

    from .points import WIDTH_KINDS, config_width

    cfg = AutoConfig.from_pretrained(name_or_path, revision=revision)
    cfg = getattr(cfg, "text_config", None) or cfg
    return ModelInfo(
        n_layers=int(_first(cfg, "num_hidden_layers", "n_layer")),
        width=int(_first(cfg, "hidden_size", "n_embd")),
        max_position=int(_first(cfg, "max_position_embeddings", "n_positions", default=2048)),
        vocab_size=int(cfg.vocab_size),
        # Hyper-connection trunks keep several residual streams; the configs name it differently.
        n_streams=int(_first(cfg, "hc_mult", "num_residual_streams", default=1)),
        architecture=(cfg.architectures or [type(cfg).__name__])[0],
        kinds=tuple((k, w) for k in WIDTH_KINDS if (w := config_width(cfg, k))),
    )


def validate_tokens(tokens: Sequence[int], max_len: int, vocab_size: int) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("each request must be a non-empty flat list of token ids")
    if ids.size > max_len:
        raise ValueError(
            f"a request has {ids.size} tokens but the engine takes at most {max_len}: "
            "lower context_size or raise max_model_len (up to the model's limit)")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size}): got {int(ids.min())}..{int(ids.max())}")
    return ids.astype(np.int32)
