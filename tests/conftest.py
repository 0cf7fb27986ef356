"""Shared fixtures live in tests/fixtures/*; each module owns one real service or artifact.

Markers: `slow` is every test that starts vLLM, Ray, a model or a run in a subprocess (modules
say so with `pytestmark`; a test elsewhere that asks for an engine or Ray fixture is marked here).
`pytest -m "not slow"` is the unit subset (store, reader, config, plan, infra): about two minutes (ruff and mypy included).

Two workers (pyproject's addopts: `-n 2 --dist loadgroup`): every slow test is in the xdist group
`engines`, which one worker runs one test at a time in file order (one vLLM engine at a time, a
Ray cluster of 2 CPUs, timings as on a quiet box); the other worker runs the unit subset and the
slow modules marked `beside_engines` (no vLLM engine, no Ray cluster, nothing timed) beside it.
The engine tests leave about a third of the 2 cores idle (Ray and engine start-ups, subprocesses,
waits); the other worker uses it. `-n 0` runs everything in this process.
"""

import pytest

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.s3",
    "tests.fixtures.ray_cluster",
    "tests.fixtures.pipeline_data",
]

# fixtures that mean a model, an engine or a Ray cluster: a test asking for one is slow
SLOW_FIXTURES = frozenset({"tiny_models", "tiny_llama", "smollm2", "reference", "ray_cluster",
                           "ray_head"})


@pytest.hookimpl(tryfirst=True)  # before xdist's hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") and not item.get_closest_marker("beside_engines"):
            item.add_marker(pytest.mark.xdist_group("engines"))
