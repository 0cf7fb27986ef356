"""The capture runners and workers, installed explicitly through vLLM's `worker_cls`.

vLLM builds the worker named in `parallel_config.worker_cls`; ours subclasses the platform's and
gives it a model runner subclass of whichever runner vLLM chose (V1 or V2, engine/vllm/compat.py
`choose_runner`) whose `load_model` installs the taps (before vLLM compiles and captures graphs)
and whose `execute_model` moves the step's rows out. Nothing is patched on import and nothing
lives in module globals: the capture state is `runner.harvest`, built from the engine's own
`additional_config["harvest"]`, and the capture loop gets it by one worker call. An engine built
without our `worker_cls` is plain vLLM, untouched.

The runner classes are made on first use, not at import: a vLLM without V1 (0.34) has none of
V1's classes, and V2's modules must load after vLLM's plugins ran (compat.v2_runner_classes).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from . import compat
from . import rowmap as harvest
from .messages import WorkerInfo

# the platform's workers, found at run time (compat.py): Any to the type checker
_workers = compat.worker_classes()
_GPUWorker: Any = _workers["gpu"]
_CPUWorker: Any = _workers["cpu"]


class HarvestRunnerMixin:
    """Taps at load time, one ticket of copies per step; inert without a harvest config."""

    harvest: "harvest.HarvestState | None" = None
    harvest_runner: str   # "v1" or "v2": which of vLLM's runners the class extends (runner_class)

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        cfg = compat.harvest_config(self.vllm_config)
        if cfg is not None and self.harvest is None:
            self.harvest = harvest.setup(self, cfg)
        return out

    def execute_model(self, scheduler_output, *args, **kwargs):
        st = self.harvest
        if st is None or not compat.real_step(scheduler_output, kwargs):
            return super().execute_model(scheduler_output, *args, **kwargs)
        st.before_forward(self, scheduler_output)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        st.after_forward(self, scheduler_output)
        return out


class HarvestV2Mixin:
    """Model Runner V2 builds each step's input batch in `prepare_inputs` and keeps no persistent
    one; the batch of the step running now is kept here for the row map (compat.step_layout)."""

    harvest_step_batch: Any = None

    def execute_model(self, scheduler_output, *args, **kwargs):
        self.harvest_step_batch = None   # never the previous step's
        return super().execute_model(scheduler_output, *args, **kwargs)

    def prepare_inputs(self, *args, **kwargs):
        self.harvest_step_batch = batch = super().prepare_inputs(*args, **kwargs)
        return batch


class SeededCPUSamplingMixin:
    """V1 on the CPU build: fixes seeded sampling (compat.snapshot_generators): without it, a
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


@cache
def runner_class(kind: str, device: str) -> type:
    """Our runner for vLLM's `kind` ("v1"/"v2") runner on `device` ("gpu"/"cpu")."""
    base = (compat.v2_runner_classes() if kind == "v2" else compat.v1_runner_classes())[device]
    mixins: tuple = (HarvestRunnerMixin,)
    if kind == "v2":
        mixins += (HarvestV2Mixin,)
    elif device == "cpu":
        mixins += (SeededCPUSamplingMixin,)
    name = f"Harvest{'CPU' if device == 'cpu' else 'GPU'}ModelRunner{kind.upper()}"
    return type(name, (*mixins, base), {"__module__": __name__, "__qualname__": name,
                                        "harvest_runner": kind})


def _kind(worker) -> str:
    return "v2" if compat.uses_v2_runner(worker) else "v1"


class _HarvestRPC:
    """Reached with LLM.collective_rpc; in-process, the objects come back by reference."""

    model_runner: HarvestRunnerMixin   # the platform worker's, set by its __init__/init_device

    def harvest_state(self) -> "harvest.HarvestState | None":
        return self.model_runner.harvest

    # Tensor parallel: the workers are other processes; these take and return plain values.
    def harvest_dist_ident(self) -> str | None:
        """The name vLLM's CPU workers give their process group's /dev/shm files
        (`<ident>-...-cpushm_<rank>`): the engine removes them at close, a killed rank cannot."""
        import os

        return os.environ.get("VLLM_DIST_IDENT")

    def harvest_info(self) -> WorkerInfo | None:
        st = self.model_runner.harvest
        if st is None:
            return None
        report = dict(st.layers.report) if st.layers is not None else {}
        return WorkerInfo(mode=st.mode, runner=self.model_runner.harvest_runner, report=report,
                          publishes=st.ring is not None,
                          publishes_stats=bool(compat.parallel_ranks()["output_rank"]),
                          summary=st.summary())

    def harvest_set_poison(self, on: bool) -> None:
        self.model_runner.harvest.poison = bool(on)

    def harvest_set_steer(self, addr: str, values) -> None:
        """Every rank adds the vector: the stream it shifts is replicated on every rank."""
        import torch

        from ..addresses import Address

        vec = self.model_runner.harvest.taps.steer[Address.parse(addr)]
        vec.copy_(torch.as_tensor(values, dtype=vec.dtype))


class HarvestGPUWorker(_HarvestRPC, _GPUWorker):
    def _make_model_runner(self):
        if compat.is_mm_encoder_only(self.vllm_config):
            raise compat.VLLMIncompatible("an encoder-only multimodal engine has no decoder to "
                                          "capture from")
        return runner_class(_kind(self), "gpu")(self.vllm_config, self.device)


class HarvestCPUWorker(_HarvestRPC, _CPUWorker):
    def init_device(self):
        super().init_device()
        # CPUWorker.init_device builds the CPU runner inline (no factory to override); our
        # subclass adds methods only, so switching the instance's class changes no state.
        kind = _kind(self)
        base = (compat.v2_runner_classes() if kind == "v2" else compat.v1_runner_classes())["cpu"]
        if type(self.model_runner) is not base:
            raise compat.VLLMIncompatible(
                f"CPUWorker built a {type(self.model_runner).__module__}."
                f"{type(self.model_runner).__name__}, not {kind.upper()}'s CPUModelRunner "
                f"({base.__module__}): the capture runner cannot extend it")
        self.model_runner.__class__ = runner_class(kind, "cpu")
