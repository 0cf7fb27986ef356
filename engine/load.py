"""`load_model`: a capture engine by backend name, for hub names, paths and the offline aliases.

Its own module (not the package's `__init__`) so the modules that load engines themselves
(model_check.py's reference subprocess and check_model) import it at the top: defined in
`__init__`, it could only be reached through a function-level import that hid an
engine <-> check import cycle.
"""

from __future__ import annotations

from .models import resolve_model

BACKENDS = ("vllm", "eager")   # the one list: config validation (pipeline.sections) reads it


def load_model(name_or_path: str, backend: str = "vllm", freeze_points="auto", **engine_args):
    """Load a model for capture through the same from_pretrained path for hub names and paths.

    `smollm2` and `tiny:<arch>` resolve here as in pipeline configs (engine.models.resolve_model):
    offline checkpoints built once under the cache, so a snippet runs without the hub.
    """
    if backend not in BACKENDS:  # before resolving: that may ask the hub
        raise ValueError(f"backend={backend!r} is not known: use one of {', '.join(BACKENDS)}")
    name_or_path = resolve_model(name_or_path)
    # The backends are imported here, not at the top: each pulls in torch (and vLLM), which
    # `import harvest.engine` must not cost (pipeline config validation reads BACKENDS).
    if backend == "vllm":
        from .vllm.backend import VLLMModel

        if engine_args.get("enforce_eager") and freeze_points == "auto":
            freeze_points = None  # enforce_eager alone asks for the hooked mode
        return VLLMModel(name_or_path, freeze_points=freeze_points, **engine_args)
    from .hf_backend import HFModel

    return HFModel(name_or_path, **engine_args)
