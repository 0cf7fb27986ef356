"""Shared fixtures live in tests/fixtures/*; each module owns one real service or artifact.

Markers: `slow` is every test that starts vLLM, Ray, a model or a run in a subprocess (modules
say so with `pytestmark`; a test elsewhere that asks for an engine or Ray fixture is marked here).
`pytest -m "not slow"` is the unit subset (store, reader, config, plan, infra): about two minutes (ruff and mypy included).
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


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
