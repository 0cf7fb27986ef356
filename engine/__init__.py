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

from .. import lazy_name

from .addresses import Address, FreezePlan, FreezeSet, KNOWN_POINTS, resolve_freeze_points
from .load import BACKENDS, load_model

# Names whose modules import torch are loaded on first use (PEP 562), so `harvest.engine.addresses`,
# which pipeline config validation reads (the point kinds), costs no torch import (3 s here).
_LAZY = {"ActivationCache": "capture.captured", "CapturedRequest": "capture.captured",
         "to_numpy": "capture.captured", "run_with_cache": "capture.captured",
         "GenerateParams": "vllm.generate", "GeneratedRequest": "vllm.generate",
         "CheckConfig": "model_check", "check_loaded": "model_check", "check_model": "model_check",
         "TrunkRefused": "capture.probe"}


def __getattr__(name: str):
    return lazy_name(__name__, _LAZY, name)


__all__ = ["ActivationCache", "Address", "BACKENDS", "CapturedRequest", "CheckConfig", "FreezePlan",
           "FreezeSet", "GenerateParams", "GeneratedRequest", "KNOWN_POINTS",
           "TrunkRefused", "check_loaded", "check_model", "load_model", "resolve_freeze_points",
           "run_with_cache", "to_numpy"]
