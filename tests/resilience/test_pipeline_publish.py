"""The driver keeps "committed" meaning "readable by every reader" (issue 37 items 2, 3, 5).

The real driver on the test cluster, the tiny model on the eager engine, rows compared bit for
bit with the single-process reference: a store the old `Store.finalize` shrank while its plan was
partly committed, `harvest finalize` on it, then the resume; a SIGTERM that arrives while a
committed unit is still unpublished (its objects under its attempt's name, no publish record).
The lifecycle scenario on S3 is in test_pipeline_e2e.py (on the clean S3 run's store).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import zarr

from harvest.pipeline.cli.main import main
from harvest.pipeline.driver.run import run
from harvest.store import open_store
from harvest.store.format import layout
from tests.support.pipeline import make_cfg, reference_rows
from tests.support.ray_actors import wait_actors_gone

# Ray pipeline runs (eager): not in `pytest -m 'not slow'`; beside the vLLM engine tests
pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]


class _Stop(Exception):
    pass


def _committed_after(cfg, n: int) -> list[int]:
    """Run until `n` units committed, stop the driver, keep exactly those units."""
    done: list = []

    def hook(e):
        if e["event"] == "unit_done" and e["status"] == "committed":
            done.append(e["unit_id"])
            if len(done) == n:
                raise _Stop()

    with pytest.raises(_Stop):
        run(cfg, on_event=hook)
    wait_actors_gone(60, "the stopped run's actors")
    store = open_store(cfg.store.resolved_url)
    for name in store.ledger.marker_names():
        if name.unit_id not in done:
            store.uncommit(name.unit_id)
    return sorted(done)


def _zarr_rows(url: str, point: str, a: int, b: int) -> np.ndarray:
    """What a reader that knows only zarr reads (after `import harvest.store`)."""
    return zarr.open_array(os.path.join(url, layout.point_path(point)), mode="r")[a:b]


def _assert_rows(store, acts: dict, a: int, b: int, zarr_only: bool = False):
    for p in store.points:
        got = _zarr_rows(store.url, p, a, b) if zarr_only else store.read(p, a, b)
        same = np.asarray(got).view(np.uint16) == acts[p][a:b].view(np.uint16)
        assert same.all(), f"{p}: rows [{a}, {b}) differ from the reference"


def test_a_store_shrunk_by_the_old_finalize_resumes_after_harvest_finalize(
        ray_cluster, tiny_llama, corpus, reference, tmp_path, capsys):
    """Issue 37 items 2-3: finalize refuses a partly committed store; a store the old API
    shrank (arrays cut to the highest committed row, finalize attributes written) is left as
    is by `harvest finalize` (it says why), and the resume grows it back and finishes it,
    bit-equal to the reference."""
    import zarr as _z

    from harvest.store.errors import StoreError
    from harvest.store.commit.finalize import _shrink

    url = str(tmp_path / "store")
    cfg = make_cfg(tiny_llama, url, corpus, "packing.max_tokens=1024")
    done = _committed_after(cfg, 2)
    s = open_store(url)
    with pytest.raises(StoreError, match=r"not finished: 2 of its 4 planned units are not committed"):
        s.finalize()
    end = max(u * 256 + 256 for u in done)
    _shrink(s, end)                                     # what the old Store.finalize did
    g = _z.open_group(store=s.zarr_store, mode="r+", zarr_format=3)
    h = dict(g.attrs["harvest"])
    h["n_rows"] = end
    g.attrs.update({"harvest": h, "finalized_at": "2026-12-01T00:00:00", "committed_rows": 512,
                    "summary": {"tokens": 512}})
    assert main(["finalize", url]) == 1
    out = capsys.readouterr().out
    assert "not finalized: 2 of its 4 planned units are not committed" in out
    assert open_store(url).n_rows == end                # harvest finalize shrinks nothing

    summary = run(cfg)
    assert summary["units_run"] == 2 and summary["units_skipped"] == 2
    store = open_store(url)
    v = store.verify(deep=True)
    assert v.ok and v.committed_rows == 1024 and store.n_rows == 1024, v.errors
    tok, _, _ = store.read_row_meta(0, 1024)
    assert np.array_equal(tok, reference_rows(cfg).token_ids)
    _assert_rows(store, reference[1], 0, 1024)
    _assert_rows(store, reference[1], 0, 1024, zarr_only=True)


def test_sigterm_publishes_what_is_committed(ray_cluster, tiny_llama, corpus, reference, tmp_path):
    """Issue 37 item 5: SIGTERM arrives while a committed unit is not yet published (made
    deterministic: its objects are put back under its attempt's name and its record removed
    before the signal); the driver publishes it on the way out, so a zarr-only reader reads it
    exactly, and `status` counts nothing unpublished."""
    from harvest.pipeline.driver.exits import Terminated
    from harvest.store.commit.published import unit_objects

    url = str(tmp_path / "store")
    cfg = make_cfg(tiny_llama, url, corpus, "packing.max_tokens=1024", "ray.num_actors=1")
    hit: list = []

    def hook(e):
        if e["event"] == "unit_done" and e["status"] == "committed" and not hit:
            s = open_store(url)
            m = s.ledger.commit_manifest(e["unit_id"])
            for o in unit_objects(s, m):
                dst = os.path.join(url, o.attempt_key)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                os.rename(os.path.join(url, o.final), dst)
            os.remove(os.path.join(url, layout.published_key(m.unit_id, m.attempt)))
            # (other units may be between their marker and their record at this moment)
            assert m.unit_id in open_store(url).ledger.unpublished_units()
            hit.append(m)
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Terminated):
        run(cfg, on_event=hook)
    wait_actors_gone(60, "the stopped run's actors")
    (m,) = hit
    store = open_store(url)
    assert m.unit_id not in store.ledger.unpublished_units()
    _assert_rows(store, reference[1], m.row_start, m.row_end, zarr_only=True)
