"""Both of vLLM's model runners in one suite: V1 (the CPU build's own) and V2 (the only one left
in vLLM 0.34), chosen per engine by HARVEST_MODEL_RUNNER (engine/vllm/compat.choose_runner).

On this CPU build V2 runs through Triton's interpreter (testing/triton_interpreter.py, whose
`model_runner` context this re-exports): in this process (the in-process engine core) and,
through the environment, in the processes an engine spawns (TP ranks) or a run starts (Ray
actors, where vLLM's plugin hook enables it). tests/conftest.py puts TRITON_INTERPRET=1 in the
environment before anything imports triton, which the interpreter needs and which changes
nothing where vLLM has no Triton; tests/fixtures/models.py primes V2's modules before the first
engine. Modules choose their tier: `RUNNERS` runs a test on both, `params(cases, v2=...)` some
cases on V2 as well.
"""

from __future__ import annotations

from harvest.testing.triton_interpreter import model_runner, needs_interpreter

__all__ = ["RUNNERS", "model_runner", "needs_interpreter", "params"]

RUNNERS = ("v1", "v2")


def params(cases, v2=None, extended=()) -> list:
    """pytest params `(case, runner)`: every case on V1, and `v2` (default: every case) on V2,
    with ids like `llama-v2`; the ids in `extended` run in the full tier only (tests/conftest.py)."""
    import pytest

    v2 = cases if v2 is None else v2

    def one(c, runner):
        id_ = f"{c}-{runner}"
        return pytest.param((c, runner), id=id_,
                            marks=(pytest.mark.extended,) if id_ in extended else ())

    return [one(c, "v1") for c in cases] + [one(c, "v2") for c in v2]
