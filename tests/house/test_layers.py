"""The layers: which part of harvest may import which, function-level imports included.

- `harvest.store` and `harvest.engine` import nothing else of harvest (but `harvest` itself, for
  the version): SAE trainers install the store alone, and the engine runs inside vLLM workers that
  know nothing of the pipeline.
- Within the pipeline the layers run cli > stream > driver > actor > data > config, and an import only
  ever points down (or within its own layer). The pipeline's top-level modules (errors.py,
  messages.py, logs.py and the package itself) are the base layer below config: errors and the
  cross-process messages are facts every layer names, and they import nothing of the pipeline.

The graph is the import-graph test's (tests/house/test_import_graph.py): imports anywhere in a module
count, imports under `if TYPE_CHECKING:` (annotations only, never run) do not.
"""

from __future__ import annotations

from tests.support.source_tree import modules
from tests.support.import_graph import import_graph

# lowest first; the pipeline's top-level modules are the base layer
PIPELINE_LAYERS = ("base", "config", "data", "actor", "driver", "stream", "cli")
SELF_CONTAINED = ("harvest.store", "harvest.engine")


def _part(module: str) -> str:
    """harvest.store.read.dataset -> harvest.store; harvest -> harvest."""
    return ".".join(module.split(".")[:2])


def pipeline_layer(module: str) -> int | None:
    """The layer's rank of a pipeline module (None outside the pipeline)."""
    parts = module.split(".")
    if parts[:2] != ["harvest", "pipeline"]:
        return None
    sub = parts[2] if len(parts) > 2 else "base"
    return PIPELINE_LAYERS.index(sub) if sub in PIPELINE_LAYERS else 0


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            if _part(m) in SELF_CONTAINED and _part(d) != _part(m) and d != "harvest":
                out.append(f"{m} -> {d} ({_part(m)} imports nothing else of harvest)")
            lm, ld = pipeline_layer(m), pipeline_layer(d)
            if lm is not None and ld is not None and ld > lm:
                out.append(f"{m} -> {d} (upward: {PIPELINE_LAYERS[lm]} below {PIPELINE_LAYERS[ld]})")
    return out


def test_every_import_points_down_the_layers():
    mods = modules()
    # every pipeline sub-package is a known layer: a new folder must be placed on purpose
    subs = {m.split(".")[2] for m in mods if m.startswith("harvest.pipeline.") and mods[m][1]}
    assert subs <= set(PIPELINE_LAYERS), f"pipeline packages with no layer: {subs - set(PIPELINE_LAYERS)}"
    assert {"harvest.store.store", "harvest.engine.protocol"} <= set(mods)  # the roots are scanned
    bad = violations(import_graph(mods))
    assert not bad, ("layer violations (move the shared piece down to the layer that owns it, "
                     "or import from the owner instead of a re-export):\n  " + "\n  ".join(bad))


def test_an_upward_or_outward_import_is_found():
    graph = {"harvest.pipeline.config.run": {"harvest.pipeline.actor.engine"},
             "harvest.pipeline.driver.run": {"harvest.pipeline.data.unit_rows", "harvest.pipeline.errors"},
             "harvest.pipeline.errors": {"harvest.pipeline.config.run"},
             "harvest.store.store": {"harvest", "harvest.pipeline.errors", "harvest.store.read"},
             "harvest.engine.load": {"harvest.store.format.dtypes"}}
    bad = violations(graph)
    assert bad == [
        "harvest.engine.load -> harvest.store.format.dtypes (harvest.engine imports nothing else of harvest)",
        "harvest.pipeline.config.run -> harvest.pipeline.actor.engine (upward: config below actor)",
        "harvest.pipeline.errors -> harvest.pipeline.config.run (upward: base below config)",
        "harvest.store.store -> harvest.pipeline.errors (harvest.store imports nothing else of harvest)",
    ], bad
