"""harvest: activation capture (freeze-mode vLLM taps) -> sharded Zarr v3 stores -> SAE readers.

Every import is `harvest.<part>`: `harvest.engine` (capture engines), `harvest.pipeline` (data,
the Ray driver and actors, the CLI), `harvest.store` (the store and its SAE-training reader),
`harvest.jobs` (`ray job submit` entrypoints), `harvest.benchmarks` and `harvest.testing` (test
servers, synthetic data). The folders stay at the repository root
(`engine/`, `pipeline/`, ...); pyproject.toml's `package-dir` installs them under this one name,
so no top-level `pipeline` or `engine` of ours collides with another library's.

Inside the package every import of harvest is relative (`from ...store import open_store` in
pipeline/driver/): the folders are harvest's subpackages only through package-dir, so a relative
import is the spelling that names the imported file by its place beside the importer, and
whoever follows paths (a reader, grep, a tool drawing the import graph) sees the real graph.
Tests, examples, infra scripts and module names handed to another process (vLLM's `worker_cls`,
`python -m harvest...`) use the absolute name, the only one they have
(tests/house/test_import_style.py).

Run from a checkout without an install (a worktree with PYTHONPATH set to it, the GPU host that
has no vLLM or Ray to install harvest against), `harvest.engine` must still resolve to the
checkout's `engine/`. The lines below add the checkout root to this package's search path, and
only when this file sits in a checkout (a `pyproject.toml` naming the project beside `engine/`):
an installed copy in site-packages never searches site-packages as `harvest.*`.
"""

import importlib as _importlib
import os as _os
import sys as _sys

__version__ = "0.1.0"   # the one version: the package, the light package and created_by in stores

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
        _os.path.join(_root, "engine")) and _root not in __path__:
    __path__.append(_root)
del _os, _root


def lazy_name(package: str, names: "dict[str, str]", name: str):
    """PEP 562 for a package of ours (harvest.engine, harvest.store): `name`, one of `names`
    ({name: module relative to `package`}), imported from its module on first use and kept on the
    package, so names whose modules import torch cost nothing until asked for."""
    if name not in names:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{names[name]}", package), name)
    setattr(_sys.modules[package], name, value)
    return value


def __getattr__(name: str):
    """`harvest.stream(config, points=..., batch_size=..., rank=..., world_size=...)`: a trainer
    rank's batches straight from a capture run (harvest.pipeline.stream.api.stream), imported on
    first use so `import harvest` stays light (the store's light install has no pipeline)."""
    if name == "stream":
        return getattr(_importlib.import_module(".pipeline.stream.api", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
