"""Every class owns the state it uses: no method reads `self.x` that the class (or a base class in
the same module) never defines.

The dispatch loop's health checks were a mixin that used 22 attributes of the scheduler it was
mixed into (issue 23): reading it alone, nobody could tell what `self.probing` was or who set
it, and renaming a scheduler field broke the mixin at run time, minutes into a run. Defined here
means assigned to `self.x` anywhere in the class, a method or property, a class-level name, a
dataclass field or a `__slots__` entry. Classes with a base from another module (a vLLM or
stdlib class, a base imported from elsewhere) are skipped: their attributes cannot be read from
the one file.
"""

from __future__ import annotations

import ast

from tests.support.source_tree import modules

# Classes meant to be mixed into another module's class, as (module, class). vLLM's runner
# mixins reach the vLLM object they are mixed into; the reader's piece planning is a mixin of
# the reader's dataset (its state is the dataset's) and is the store's to rework; so is follow mode.
ALLOWED = {
    ("harvest.engine.vllm.runner", "HarvestRunnerMixin"),
    ("harvest.engine.vllm.runner", "_HarvestRPC"),
    ("harvest.store.read.shuffle.order", "PiecePlanning"),
    ("harvest.store.read.follow", "FollowMode"),
}


def _self_attrs(cls: ast.ClassDef, ctx) -> set[str]:
    return {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ctx)}


def _defined(cls: ast.ClassDef, classes: dict) -> set[str]:
    names = _self_attrs(cls, ast.Store)
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                    if t.id == "__slots__" and isinstance(n.value, (ast.Tuple, ast.List)):
                        names |= {e.value for e in n.value.elts if isinstance(e, ast.Constant)}
    for b in cls.bases:
        names |= _defined(classes[b.id], classes)
    return names


def _local(cls: ast.ClassDef, classes: dict) -> bool:
    """Whether every ancestor of `cls` is defined in the same module."""
    return all(isinstance(b, ast.Name) and b.id in classes and _local(classes[b.id], classes)
               for b in cls.bases)


def undefined_attributes(source: str) -> dict[str, list[str]]:
    """{class: attributes it reads on self and never defines} for one module's source."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    out = {}
    for name, cls in classes.items():
        if not _local(cls, classes):
            continue
        missing = {a for a in _self_attrs(cls, ast.Load) - _defined(cls, classes)
                   if not a.startswith("__")}
        if missing:
            out[name] = sorted(missing)
    return out


def test_no_class_reads_state_it_does_not_define():
    bad = [f"{m}.{c} uses {attrs}" for m, (path, _) in sorted(modules().items())
           for c, attrs in undefined_attributes(path.read_text()).items() if (m, c) not in ALLOWED]
    assert not bad, ("give the class the state it uses (or hold the object that owns it): "
                     + "; ".join(bad))


def test_a_mixin_that_borrows_its_hosts_state_is_caught():
    src = ("class Health:\n    def lose(self, a):\n        self.alive.discard(a)\n\n"
           "class Owner:\n    __slots__ = ('alive',)\n    def lose(self, a):\n"
           "        self.alive.discard(a)\n\n"
           "class Base:\n    def __init__(self):\n        self.n = 0\n\n"
           "class Child(Base):\n    def inc(self):\n        self.n += 1\n        return self.m\n")
    assert undefined_attributes(src) == {"Health": ["alive"], "Child": ["m"]}
