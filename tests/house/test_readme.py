"""README.md's and docs/*.md's code blocks run as written, and their links and paths resolve.

Every ```python block is executed verbatim in a fresh interpreter (one vLLM engine per process),
with checks on what its comments promise appended after it. Every ```bash block is either run
here or listed in COVERED with the test that runs it, so a new block cannot slip in untested.
The reader block (docs/store.md) opens `.harvest/stores/default` (the default run's store): here
that is a store built by the test in a scratch working directory, so the test needs no vLLM run
of its own. The structural checks (blocks covered, links, paths, the engine's module table) are
fast and run in `pytest -m 'not slow'` too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harvest.engine.models import REPO_ROOT
from tests.support.readme import PAGES, README, blocks

# python blocks per page (path from the repository root); each is run by a test below
PYTHON_BLOCKS = {"README.md": 0, "docs/engine.md": 1, "docs/store.md": 3}

# bash blocks (first command line) -> where they are exercised instead of here
COVERED = {
    "bash .ci/install && .venv/bin/harvest run": "CI's install; the quiet default run: "
                                                 "tests/pipeline/test_pipeline_cli.py (tiny equivalent)",
    "bash .ci/install && .venv/bin/python -m pytest tests": "CI itself (.ci/run)",
    "harvest check-model": "tests/engine/test_check_model.py",
    ".venv/bin/harvest run": "tests/pipeline/test_pipeline_cli.py (run/plan/status/verify/inspect forms)",
    "export RAY_AUTH_MODE=token": "tests/ops/test_jobs.py (parses and runs this very command)",
}


def _rel(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def _run(code: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r


def _block(start: str) -> str:
    found = [b for b in blocks("python") if b.lstrip().startswith(start)]
    assert len(found) == 1, f"README/docs have {len(found)} python blocks starting with {start!r}"
    return found[0]


def test_every_block_is_run_here_or_covered():
    counts = {_rel(p): len(blocks("python", p)) for p in PAGES}
    expected = {k: v for k, v in PYTHON_BLOCKS.items() if v}
    assert {k: v for k, v in counts.items() if v} == expected, \
        f"a new python block: run it in this file ({counts})"
    for b in blocks("bash"):
        first = b.strip().splitlines()[0]
        assert any(first.startswith(k) for k in COVERED), f"bash block not covered: {first}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_and_anchors_resolve():
    """Every relative link of the README and docs/ names a file that exists (and its heading)."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{_rel(page)}: link to {target} names no file"
            if anchor:
                heads = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
                assert anchor in {_slug(h) for h in heads}, \
                    f"{_rel(page)}: no heading #{anchor} in {path or 'itself'}"


TOP = ("engine", "pipeline", "jobs", "infra", "benchmarks", "tests", "examples", "packages",
       "harvest", "testing")


def test_repository_paths_named_exist():
    """A `folder/file` in backticks on these pages is a file or folder of this repository."""
    for page in PAGES:
        for tok in re.findall(r"`([^`\s]+)`", page.read_text()):
            if tok.split("/")[0] in TOP and "/" in tok and not re.search(r"[<>*{]", tok):
                assert (REPO_ROOT / tok).exists(), f"{_rel(page)} names {tok}, which does not exist"


def test_engine_page_lists_every_engine_module():
    """docs/engine.md's module table has a row for every file of engine/ and its folders, and no other."""
    page = (REPO_ROOT / "docs" / "engine.md").read_text()
    table = page.split("## Modules", 1)[1].split("\n## ")[0]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, re.M))
    engine = REPO_ROOT / "engine"
    assert listed == {str(p.relative_to(engine)) for p in engine.rglob("*.py")}


def test_readme_tour_names_where_a_row_goes():
    """tapped, mapped, copied, written, committed, read: each step and its files, in the README."""
    text = README.read_text()
    for step, files in {"tapped": ["engine/capture/taps.py"],
                        "mapped": ["engine/vllm/rowmap.py", "engine/capture/coverage.py"],
                        "copied": ["engine/capture/transport.py"],
                        "written": ["store/write/writer.py", "store/write/uploads.py"],
                        "committed": ["store/commit/markers.py"],
                        "read": ["store/read/dataset.py"]}.items():
        row = [ln for ln in text.splitlines() if ln.startswith(f"| **{step}**")]
        assert len(row) == 1, step
        assert all(f"`{f}`" in row[0] for f in files), (step, row[0])


@pytest.mark.slow  # a vLLM engine
def test_engine_block_runs_offline_with_string_keys(smollm2, tmp_path):
    """load_model("smollm2") resolves offline; caches take "resid_post.3"; capture streams."""
    code = _block("from harvest.engine import load_model") + textwrap.dedent("""
        import torch
        from harvest.engine import Address
        c = caches[0]["resid_post.3"]
        assert tuple(c.shape) == (3, 576) and c.dtype == torch.bfloat16, (c.shape, c.dtype)
        assert torch.equal(c, caches[0][Address("resid_post", 3)])
        assert tuple(caches[1]["resid_post.29"].shape) == (2, 576)
        # the same tokens give the same rows in a later capture (batch composition is irrelevant)
        again = run_with_cache(model, [[1, 88]], ["resid_post.3"])[0]["resid_post.3"]
        assert torch.equal(again, caches[1]["resid_post.3"])
        got = {r.index: r for r in model.capture(batches, points=None)}
        assert sorted(got) == [0, 1, 2] and tuple(got[2].acts.shape) == (30, 4, 576)
        assert got[1].token_ids.tolist() == [1, 88] and got[0].positions.tolist() == [0, 1, 2, 3]
        print("engine block ok")
    """)
    assert "engine block ok" in _run(code, tmp_path).stdout


@pytest.fixture(scope="module")
def default_like_store(tmp_path_factory):
    """`.harvest/stores/default` in a scratch cwd: packed contexts with a BOS per context and
    special ids recorded, rows with a few huge-norm sinks, 11 layers so resid_post.10 exists."""
    from harvest.store import create_store
    from harvest.testing import synthetic
    from tests.support.reader_stores import BOS, packed_meta

    cwd = tmp_path_factory.mktemp("readme")
    n, width, context = 16384, 64, 128
    points = [f"resid_post.{i}" for i in (0, 10)]
    s = create_store(str(cwd / ".harvest" / "stores" / "default"), points=points, width=width,
                     n_rows=n, shard_rows=2048, chunk_rows=512, context_size=context,
                     special_token_ids=[0, BOS, 2], bos_token_id=BOS, stats_skip_positions=2,
                     attrs={"config": {"packing": {"context_size": context}}})
    data = synthetic.activations((len(points), n, width), seed=3)
    tok, doc, pos = packed_meta(n, context, seed=3)
    s.ledger.write_plan(s.ledger.default_plan(1))
    synthetic.fill(s, data, units=s.ledger.plan(), token_id=tok, doc_id=doc, position=pos)
    s.finalize({"status": "complete"})
    return cwd


@pytest.mark.slow  # a store built and read
def test_reader_block_yields_what_its_comments_say(default_like_store):
    """float32 batches of up to 4096 rows, normalised so that E||x||^2 = width."""
    code = _block("from harvest.store import open_store") + textwrap.dedent("""
        import torch
        # the loop's last batch: float32, width columns, at most 4096 rows (the epoch's tail)
        assert x.dtype == torch.float32 and x.shape[1] == store.width and 0 < x.shape[0] <= 4096
        assert ds.norm_constants.source in ("store:kept", "sample"), ds.norm_constants.source
        sq = float((x.double() ** 2).sum(1).mean())
        assert 0.8 * store.width < sq < 1.25 * store.width, sq
        print("reader block ok", sq)
    """)
    assert "reader block ok" in _run(code, default_like_store, timeout=300).stdout


@pytest.mark.slow  # a store built and read
def test_ledger_block_gives_marker_records(default_like_store):
    """The ledger's markers are typed records, one per committed unit, rows in order."""
    code = _block("from harvest.store import Marker, open_store") + textwrap.dedent("""
        assert markers and all(isinstance(m, Marker) for m in markers)
        assert sorted(m.unit_id for m in markers) == [u.unit_id for u in st.ledger.plan_units()]
        assert all(m.to_json()["row_start"] == m.row_start for m in markers)
        print("ledger block ok", len(markers))
    """)
    assert "ledger block ok" in _run(code, default_like_store, timeout=300).stdout


@pytest.fixture(scope="module")
def checkpoint_like_stores(tmp_path_factory):
    """`.harvest/stores/step-1000` and `step-2000` in a scratch cwd: one corpus's rows (the same
    token ids, documents, positions), two models' activations."""
    from harvest.store import create_store
    from harvest.testing import synthetic
    from tests.support.reader_stores import BOS, packed_meta

    cwd = tmp_path_factory.mktemp("readme-paired")
    n, width, context = 8192, 32, 128
    tok, doc, pos = packed_meta(n, context, seed=3)
    for seed, name in ((1, "step-1000"), (2, "step-2000")):
        s = create_store(str(cwd / ".harvest" / "stores" / name), points=["resid_post.10"], width=width,
                         n_rows=n, shard_rows=1024, chunk_rows=512, context_size=context,
                         special_token_ids=[0, BOS, 2], bos_token_id=BOS, stats_skip_positions=2)
        s.ledger.write_plan(s.ledger.default_plan(2))
        synthetic.fill(s, synthetic.activations((1, n, width), seed=seed), token_id=tok, doc_id=doc,
                       position=pos)
    return cwd


@pytest.mark.slow  # two stores built and read in a subprocess
def test_paired_reader_block_yields_what_its_comments_say(checkpoint_like_stores):
    code = _block("from harvest.store.read.adapters import crosscoder_data") + textwrap.dedent("""
        import torch
        assert ds.names == ["step-1000", "step-2000"], ds.names
        assert ds.alignment.by_digest == ds.alignment.units == 4, ds.alignment
        assert x.dtype == torch.float32 and x.shape[1:] == (2, ds.width) and 0 < x.shape[0] <= 4096
        sq = [float((x[:, i].double() ** 2).sum(1).mean()) for i in range(2)]
        assert all(0.8 * ds.width < v < 1.25 * ds.width for v in sq), sq
        print("paired block ok", sq)
    """)
    assert "paired block ok" in _run(code, checkpoint_like_stores, timeout=300).stdout
