"""The capture runner and worker, installed explicitly through vLLM's `worker_cls`.

vLLM builds the worker named in `parallel_config.worker_cls`; ours subclasses the platform's and
gives it a model runner subclass whose `load_model` installs the taps (before vLLM compiles and
captures graphs) and whose `execute_model` moves the step's rows out. Nothing is patched on
import and nothing lives in module globals: the capture state is `runner.harvest`, built from the
engine's own `additional_config["harvest"]`, and the capture loop gets it by one worker call.
An engine built without our `worker_cls` is plain vLLM, untouched.

Model Runner V2 is refused here, loudly: it rebuilds its input batch per step in a sorted order
and has none of the persistent state the row map reads (docs/engine.md: "Model Runner V2").
"""

from __future__ import annotations

from typing import Any

from . import compat
from . import rowmap as harvest

# the platform's classes, found at run time (compat.py): Any to the type checker
_runners = compat.v1_runner_classes()
_workers = compat.worker_classes()
_GPURunner: Any = _runners["gpu"]
_CPURunner: Any = _runners["cpu"]
_GPUWorker: Any = _workers["gpu"]
_CPUWorker: Any = _workers["cpu"]


class HarvestRunnerMixin:
    """Taps at load time, one ticket of copies per step; inert without a harvest config."""

    harvest: "harvest.HarvestState | None" = None

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        cfg = compat.harvest_config(self.vllm_config)
        if cfg is not None and self.harvest is None:
            self.harvest = harvest.setup(self, cfg)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        st = self.harvest
        if st is None or not compat.scheduled_tokens(scheduler_output):
            return super().execute_model(scheduler_output, *args, **kwargs)
        st.before_forward(self, scheduler_output)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        st.after_forward(self, scheduler_output)
        return out


class HarvestGPUModelRunner(HarvestRunnerMixin, _GPURunner):
    pass


class HarvestCPUModelRunner(HarvestRunnerMixin, _CPURunner):
    """Also fixes seeded sampling on the CPU build (compat.snapshot_generators): without it, a
    generation with a seed dies on the first prompt vLLM prefills in chunks."""

    _generator_states: dict | None = None

    def sample_tokens(self, *args, **kwargs):
        self._generator_states = compat.snapshot_generators(self)
        try:
            return super().sample_tokens(*args, **kwargs)
        finally:
            self._generator_states = None

    def _bookkeeping_sync(self, *args, **kwargs):
        taken = compat.rewind_discarded_generators(self, self._generator_states or {})
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            compat.restore_generators(self, taken)


def _refuse_v2(worker) -> None:
    if compat.uses_v2_runner(worker):
        raise compat.VLLMIncompatible(
            "vLLM chose Model Runner V2, which the capture engine does not support yet: set "
            "VLLM_USE_V2_MODEL_RUNNER=0 (engine.vllm_backend sets it; a feature that forces V2, "
            "such as HiSparse or watermarking, cannot be combined with capture)")


class _HarvestRPC:
    """Reached with LLM.collective_rpc; in-process, the objects come back by reference."""

    model_runner: HarvestRunnerMixin   # the platform worker's, set by its __init__/init_device

    def harvest_state(self):
        return self.model_runner.harvest

    # Tensor parallel: the workers are other processes; these take and return plain values.
    def harvest_dist_ident(self) -> str | None:
        """The name vLLM's CPU workers give their process group's /dev/shm files
        (`<ident>-...-cpushm_<rank>`): the engine removes them at close, a killed rank cannot."""
        import os

        return os.environ.get("VLLM_DIST_IDENT")

    def harvest_info(self) -> dict | None:
        st = self.model_runner.harvest
        if st is None:
            return None
        report = dict(st.layers.report) if st.layers is not None else {}
        return {"mode": st.mode, "report": report, "publishes": st.ring is not None,
                "publishes_stats": compat.parallel_ranks()["output_rank"],
                "summary": st.summary()}

    def harvest_set_poison(self, on: bool) -> None:
        self.model_runner.harvest.poison = bool(on)

    def harvest_set_steer(self, addr: str, values) -> None:
        """Every rank adds the vector: the stream it shifts is replicated on every rank."""
        import torch

        from harvest.engine.addresses import Address

        vec = self.model_runner.harvest.taps.steer[Address.parse(addr)]
        vec.copy_(torch.as_tensor(values, dtype=vec.dtype))


class HarvestGPUWorker(_HarvestRPC, _GPUWorker):
    def _make_model_runner(self):
        _refuse_v2(self)
        return HarvestGPUModelRunner(self.vllm_config, self.device)


class HarvestCPUWorker(_HarvestRPC, _CPUWorker):
    def init_device(self):
        super().init_device()
        _refuse_v2(self)
        # CPUWorker.init_device builds CPUModelRunner inline (no factory to override); the
        # subclass adds methods only, so switching the instance's class changes no state.
        if type(self.model_runner) is not _runners["cpu"]:
            raise compat.VLLMIncompatible(
                f"CPUWorker built a {type(self.model_runner).__name__}, not CPUModelRunner")
        self.model_runner.__class__ = HarvestCPUModelRunner
