"""Capture engines: an eager Hugging Face reference and vLLM with freeze-mode taps.

    model = load_model("path/or/hub-name", backend="vllm", freeze_points="auto")
    for req in model.capture(batches_of_token_id_lists, points):   # streams finished requests
        req.index, req.token_ids, req.positions, req.acts           # acts: [points, n, width]
    model.capture(batches, points, destinations=fn)   # fn(index, n): rows land in caller memory
    caches = run_with_cache(model, token_lists, ["resid_post.3"])   # per request {Address: [n, width]}
    caches[0]["resid_post.3"]                                      # string keys work too
    gens = model.generate_with_cache(token_lists, points, GenerateParams(max_new_tokens=32))
    gens[0][0].generated, gens[0][0].point("resid_post.3")   # sampled ids; prompt + decode rows
"""

from __future__ import annotations

import importlib

from .addresses import Address, FreezePlan, FreezeSet, KNOWN_POINTS, resolve_freeze_points

# Names whose modules import torch are loaded on first use (PEP 562), so `harvest.engine.addresses`,
# which pipeline config validation reads (the point kinds), costs no torch import (3 s here).
_LAZY = {"ActivationCache": "captured", "CapturedRequest": "captured", "to_numpy": "captured",
         "CheckConfig": "check", "GenerateParams": "generate", "GeneratedRequest": "generate", "check_loaded": "check", "check_model": "check",
         "TrunkRefused": "probe"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


BACKENDS = ("vllm", "eager")   # the one list: config validation (pipeline.sections) reads it


def load_model(name_or_path: str, backend: str = "vllm", freeze_points="auto", **engine_args):
    """Load a model for capture through the same from_pretrained path for hub names and paths.

    `smollm2` and `tiny:<arch>` resolve here as in pipeline configs (engine.models.resolve_model):
    offline checkpoints built once under the cache, so a snippet runs without the hub.
    """
    from .models import resolve_model

    if backend not in BACKENDS:  # before resolving: that may ask the hub
        raise ValueError(f"backend={backend!r} is not known: use one of {', '.join(BACKENDS)}")
    name_or_path = resolve_model(name_or_path)
    if backend == "vllm":
        from .vllm_backend import VLLMModel

        if engine_args.get("enforce_eager") and freeze_points == "auto":
            freeze_points = None  # enforce_eager alone asks for the hooked mode
        return VLLMModel(name_or_path, freeze_points=freeze_points, **engine_args)
    from .hf_backend import HFModel

    return HFModel(name_or_path, **engine_args)


def run_with_cache(model, tokens, points=None) -> list[ActivationCache]:
    """Capture a list of token lists; results in submission order, one {Address: [n, width]} each
    (string keys work too: `caches[0]["resid_post.3"]`)."""
    out: list = [None] * len(tokens)
    for req in model.capture([tokens], points):
        out[req.index] = req.as_dict()
    return out


__all__ = ["ActivationCache", "Address", "CapturedRequest", "CheckConfig", "FreezePlan", "FreezeSet",
           "GenerateParams", "GeneratedRequest", "KNOWN_POINTS",
           "TrunkRefused", "check_loaded", "check_model", "load_model", "resolve_freeze_points",
           "run_with_cache", "to_numpy"]
