"""No import cycles among harvest's modules, function-level imports included.

A cycle hidden behind a deferred import (`from .cluster import x` inside a function) is still a
cycle: the two modules cannot be understood, tested or moved apart, and the import fails the
moment someone lifts the deferred line to the top. The graph here is built from the source with
`ast`, every `import`/`from ... import` in the module counted wherever it sits (module level,
function, method, try block), relative imports resolved, `from pkg import name` pointing at
`pkg.name` when that is a module and at `pkg` otherwise. Only harvest's own modules are nodes.

Not counted by the first test: imports under `if TYPE_CHECKING:` (annotations only, never run;
a later test counts them: a circle that annotations close still ties its modules together),
`importlib.import_module` with a computed name (engine/__init__.py's PEP 562 lazy
names) and the implicit import of a package's `__init__` when a submodule is imported (every
submodule would otherwise sit in a cycle with a package that re-exports it).
"""

from __future__ import annotations

from tests.support.import_graph import import_graph
from tests.support.source_tree import modules

# Cycles still known, each one entry (its modules), so fixing one is deleting its line: the
# test fails on a cycle not listed AND on a listed one that is gone (the list only shrinks).
# A cycle that shrank but is not gone (some of its modules still in one) stays allowed.
# (engine<->check, store<->finalize<->verify, store<->create, cli<->schedule_cli and
# actor<->cluster<->logs went in issue 23 item 7; so did shmdest<->stepring: the registration
# log's layout moved to shmdest, which stepring imports one way; and config -> sections ->
# generation -> chat -> data -> config: capture.generate's section moved to pipeline/config/generate.py.)
ALLOWED_CYCLES: list[set[str]] = []


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_import_cycle_outside_the_allow_list():
    found = cycles(import_graph(modules()))
    new = [sorted(c) for c in found if not any(c <= allowed for allowed in ALLOWED_CYCLES)]
    assert not new, ("import cycles (function-level imports included): " + "; ".join(
        " <-> ".join(c) for c in new) + ". Move the shared piece to the module that owns it "
        "instead of deferring an import")


def test_the_allow_list_only_shrinks():
    found = cycles(import_graph(modules()))
    gone = [sorted(a) for a in ALLOWED_CYCLES if not any(c <= a for c in found)]
    assert not gone, f"these cycles are gone: delete their lines from ALLOWED_CYCLES: {gone}"


def test_actor_cluster_logs_and_the_dispatch_modules_are_in_no_cycle():
    """The cycle actor <-> cluster <-> logs (logs imported cluster inside StartWatch.line) is
    gone, and none of the scheduler's state modules joins one."""
    mine = {f"harvest.pipeline.{m}" for m in (
        "actor.capture", "actor.engine", "driver.cluster", "logs", "driver.dispatch", "driver.tally",
        "driver.health", "driver.holdings", "driver.inflight", "driver.plan_writer", "driver.run",
        "driver.sink")}
    mods = modules()
    assert mine <= set(mods), mine - set(mods)
    hit = [sorted(c) for c in cycles(import_graph(mods)) if c & mine]
    assert not hit, hit


def test_the_config_sections_reach_no_pipeline_runtime_module():
    """Loading a config imports the sections, never the runtime modules that use them: the
    sections' imports (function-level included, followed transitively) reach no pipeline module
    but the config helpers. The cycle config -> sections -> generation -> chat -> data -> config
    came from one such import (sections.py's deferred `from .generation import from_section`)."""
    graph = import_graph(modules())
    config_side = {f"harvest.pipeline.{m}" for m in (
        "config.run", "config.sections", "config.corpus", "config.generate", "config.fields",
        "config.yamltext", "config.paths")}
    assert config_side <= set(graph), config_side - set(graph)
    seen, todo = set(), ["harvest.pipeline.config.run"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    runtime = {f"harvest.pipeline.{m}" for m in ("actor.generation", "data.chat", "data.documents", "data.default_corpus")}
    assert not seen & runtime, sorted(seen & runtime)
    # and the runtime side does import the sections (the one way the edge runs)
    assert "harvest.pipeline.config.generate" in graph["harvest.pipeline.actor.generation"]


# Cycles that only annotations close (`if TYPE_CHECKING:` imports), each with its reason. The
# same rule: the list only shrinks. read.config names NormConstants in an annotation only, so
# that a reader's config imports no torch; normalize takes its modes from the option's module.
ALLOWED_ANNOTATION_CYCLES: list[set[str]] = [
    {"harvest.store.read.config", "harvest.store.read.normalize"},
]


def test_no_cycle_closed_by_annotations_outside_the_allow_list():
    """A circle closed only by `if TYPE_CHECKING:` imports still ties its modules together (the
    store handed itself to finalize, verify and the card, which named `Store` back): counted
    here, so it cannot come back (the ledger's functions take a declared view, commit/view.py)."""
    found = cycles(import_graph(modules(), annotations=True))
    new = [sorted(c) for c in found if not any(c <= a for a in ALLOWED_CYCLES + ALLOWED_ANNOTATION_CYCLES)]
    assert not new, ("import cycles closed by annotations (if TYPE_CHECKING: imports): " + "; ".join(
        " <-> ".join(c) for c in new) + ". Name a Protocol the callee declares instead of the "
        "caller's class")
    gone = [sorted(a) for a in ALLOWED_ANNOTATION_CYCLES if not any(c <= a for c in found)]
    assert not gone, f"these cycles are gone: delete them from ALLOWED_ANNOTATION_CYCLES: {gone}"


def test_the_store_and_its_ledger_are_in_no_cycle_annotations_included():
    """store.py -> commit/ledger.py -> finalize, verify, published, card: one way."""
    mine = {"harvest.store.store", "harvest.store.card", "harvest.store.commit.ledger",
            "harvest.store.commit.finalize", "harvest.store.commit.verify",
            "harvest.store.commit.published", "harvest.store.commit.records"}
    graph = import_graph(modules(), annotations=True)
    assert mine <= set(graph), mine - set(graph)
    hit = [sorted(c) for c in cycles(graph) if c & mine]
    assert not hit, hit


def test_a_cycle_behind_a_function_level_import_is_found(tmp_path):
    """The graph sees imports inside functions and relative imports, and names the cycle; an
    import under `if TYPE_CHECKING:` is no edge."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n    return g\n")
    (pkg / "c.py").write_text("import os\n\ndef g():\n    from pkg.a import b\n    return b\n")
    (pkg / "d.py").write_text("from .a import b\n")  # imports into the cycle, not part of it
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .d import x\n")  # annotations only: no edge
    (pkg / "d.py").write_text("from .a import b\nfrom . import e\n")
    graph = import_graph(modules(tmp_path, {"pkg": "pkg"}))
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"} and graph["pkg.e"] == set()
    assert cycles(graph) == [{"pkg.a", "pkg.b", "pkg.c"}]
    # counting annotations, e's import of d is an edge, and it closes no new cycle here
    full = import_graph(modules(tmp_path, {"pkg": "pkg"}), annotations=True)
    assert full["pkg.e"] == {"pkg.d"}
    (pkg / "f.py").write_text("from typing import TYPE_CHECKING\nfrom . import g\n"
                              "if TYPE_CHECKING:\n    from . import h\n")
    (pkg / "g.py").write_text("")
    (pkg / "h.py").write_text("from . import f\n")   # f -> h only in annotations: a circle
    assert {"pkg.f", "pkg.h"} not in cycles(import_graph(modules(tmp_path, {"pkg": "pkg"})))
    assert {"pkg.f", "pkg.h"} in cycles(import_graph(modules(tmp_path, {"pkg": "pkg"}), annotations=True))


def test_every_lazy_name_of_the_engine_package_resolves():
    """harvest.engine's PEP 562 names (imported by name, so the graph above cannot see them)
    point at modules that exist and define them."""
    import harvest.engine as engine

    for name in engine.__all__:
        assert getattr(engine, name) is not None, name
