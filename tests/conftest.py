"""Shared fixtures live in tests/fixtures/*; each module owns one real service or artifact.

Markers: `slow` is every test that starts vLLM, Ray, a model or a run in a subprocess (modules
say so with `pytestmark`; a test elsewhere that asks for an engine or Ray fixture is marked here).
`pytest -m "not slow"` is the unit subset (store, reader, config, plan, infra): about one and a half
minutes (ruff and mypy included).

Two workers (pyproject's addopts: `-n 2`; tests/support/workers.py): every slow test but those
marked `beside_engines` is an engine test, and one worker runs them one at a time in file order
(one vLLM engine at a time; what times a deadline runs there too); the other worker runs the unit
subset and the slow modules marked `beside_engines` (no vLLM engine, nothing timed; eager Ray
pipeline runs on that worker's own cluster) beside it. Run one after the other, the tests left a
third of the 2 cores idle (Ray and engine start-ups, subprocesses, waits). `-n 0` runs everything
in this process.
"""

import os

# Model Runner V2 runs here through Triton's interpreter (tests/support/runners.py), which must be
# on before anything imports triton (torch's inductor does); vLLM without Triton ignores it
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.support import workers  # noqa: E402

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.s3",
    "tests.fixtures.ray_cluster",
    "tests.fixtures.pipeline_data",
]

TIERS = ("ci", "full")

# fixtures that mean a model, an engine or a Ray cluster: a test asking for one is slow
SLOW_FIXTURES = frozenset({"tiny_models", "tiny_llama", "smollm2", "reference", "ray_cluster",
                           "ray_head"})


def pytest_itemcollected(item):
    if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    parser.addoption("--tier", choices=TIERS, default=os.environ.get("HARVEST_TEST_TIER", "ci"),
                     help="ci (default: what .ci/run runs, under 25 minutes on 2 cores) or full "
                          "(adds the tests marked `extended`: the runner x family x TP cross "
                          "products whose every part the ci tier already covers once); env "
                          "HARVEST_TEST_TIER")


def pytest_configure(config):
    workers.controller_setup(config)


def pytest_unconfigure(config):
    workers.controller_teardown(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The ci tier deselects (not skips) the `extended` tests; `--tier full` runs them."""
    if config.getoption("tier") == "full":
        return
    extended = [i for i in items if i.get_closest_marker("extended")]
    if extended:
        config.hook.pytest_deselected(items=extended)
        items[:] = [i for i in items if not i.get_closest_marker("extended")]


@pytest.hookimpl(trylast=True)  # the final list, after deselection
def pytest_collection_finish(session):
    workers.worker_write(session.items)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    return workers.EngineScopeScheduling(config, log)
