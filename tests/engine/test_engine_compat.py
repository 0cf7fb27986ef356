"""The vLLM internals the engine relies on, checked against the installed vLLM (no engine start).

If this fails after a vLLM upgrade, port engine/vllm/compat.py (the one place those internals are
listed; engine/vllm/compat_check.py checks them) instead of loosening the check: a moved internal used
to skip the taps silently.
"""

from __future__ import annotations

import pytest

from harvest.engine.vllm import compat
from harvest.engine.vllm import compat_check


def test_installed_vllm_has_every_internal_the_engine_needs():
    assert compat_check.check() == []
    compat_check.require()


def test_the_version_checked_is_the_installed_one():
    # A different vLLM may still pass check(); this says which version the notes describe.
    assert compat.installed_version() == compat.VLLM_CHECKED


@pytest.mark.parametrize("cls_key, attr, named", [
    ("runner", "execute_model", "GPUModelRunner.execute_model"),
    ("worker", "_make_model_runner", "Worker._make_model_runner"),
])
def test_a_missing_internal_is_named_and_refused(monkeypatch, cls_key, attr, named):
    classes = compat.v1_runner_classes() if cls_key == "runner" else compat.worker_classes()
    monkeypatch.delattr(classes["gpu"], attr)
    assert named in compat_check.check()
    with pytest.raises(compat.VLLMIncompatible, match=named):
        compat_check.require()


def test_a_moved_runner_attribute_is_found_in_the_source(monkeypatch):
    import inspect

    real = inspect.getsource

    def renamed(obj):
        src = real(obj)
        return src.replace("self.positions = ", "self.positions_v3 = ")
    monkeypatch.setattr(inspect, "getsource", renamed)
    assert "GPUModelRunner.__init__: self.positions" in compat_check.check()


def test_importing_the_engine_patches_nothing_in_vllm():
    """The runner is a subclass named to vLLM explicitly; vLLM's own classes stay vLLM's."""
    from harvest.engine.vllm import runner  # defines the subclasses

    runners, workers = compat.v1_runner_classes(), compat.worker_classes()
    for cls, name in ((runners["gpu"], "execute_model"), (runners["gpu"], "load_model"),
                      (runners["cpu"], "load_model"), (workers["cpu"], "init_device")):
        assert getattr(cls, name).__module__.startswith("vllm."), (cls, name)
    assert issubclass(runner.HarvestCPUModelRunner, runners["cpu"])
    assert issubclass(runner.HarvestGPUWorker, workers["gpu"])


def test_vllm_cpu_kernel_scan_survives_a_process_that_loaded_numba():
    """The store's statistics kernels load numba (llvmlite), whose `binding.ffi.lib` answers any
    attribute; vllm-cpu's worker start scans every module's values (`_rebind_kernels`) and broke
    on it, so an engine could not start after a store was written in the same process. The scan,
    run here on its own (no overrides: it still visits every value), passes once the engine's
    environment is set."""
    import sys

    from harvest.store.stats import kernel
    from vllm.triton_utils import dispatcher

    assert kernel.kernels() is not None   # numba's kernels loaded: llvmlite.binding.ffi with them
    assert "llvmlite.binding.ffi" in sys.modules
    compat.engine_environment(on_cpu=True)
    dispatcher._rebind_kernels([])        # raised AttributeError before the guard
