"""Both of vLLM's model runners in one suite: V1 (the CPU build's own) and V2 (the only one left
in vLLM 0.34), chosen per engine by HARVEST_MODEL_RUNNER (engine/vllm/compat.choose_runner).

On this CPU build V2 runs through Triton's interpreter (testing/triton_interpreter.py): the
context below asks for it in this process (the in-process engine core) and, through the
environment, in the processes an engine spawns (TP ranks) or a run starts (Ray actors, where
vLLM's plugin hook enables it). tests/conftest.py puts TRITON_INTERPRET=1 in the environment
before anything imports triton, which the interpreter needs and which changes nothing where
vLLM has no Triton. Modules choose their tier: `RUNNERS` runs a test on both, `V2` on V2 alone.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from harvest.engine.vllm.compat import RUNNER_ENV
from harvest.testing import triton_interpreter

RUNNERS = ("v1", "v2")


def needs_interpreter() -> bool:
    """No CUDA: vLLM's Triton kernels run in Triton's interpreter or not at all."""
    import torch

    return not torch.cuda.is_available()


@contextmanager
def model_runner(kind: str):
    """Engines built (and run) inside this block use Model Runner `kind`."""
    keys = (RUNNER_ENV, triton_interpreter.ENV)
    saved = {k: os.environ.get(k) for k in keys}
    os.environ[RUNNER_ENV] = kind
    interp = kind == "v2" and needs_interpreter()
    if interp:
        os.environ[triton_interpreter.ENV] = "1"
        triton_interpreter.enable()
    try:
        yield kind
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if interp:
            triton_interpreter.disable()


def params(cases, v2=None) -> list:
    """pytest params `(case, runner)`: every case on V1, and `v2` (default: every case) on V2,
    with ids like `llama-v2`."""
    import pytest

    v2 = cases if v2 is None else v2
    return ([pytest.param((c, "v1"), id=f"{c}-v1") for c in cases]
            + [pytest.param((c, "v2"), id=f"{c}-v2") for c in v2])
