"""The driver <-> actor messages are typed records (issue 23 item 3).

Each crosses a process boundary pickled (Ray uses cloudpickle), so each must come back equal
through both picklers; a misspelt, unknown or missing field must fail where the message is built,
naming the field, not minutes later in another process as a KeyError.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from types import SimpleNamespace

import pytest
from ray import cloudpickle

import numpy as np

from harvest.pipeline.messages import (ActorSpec, StreamInfo, StreamRows, StreamSpec, StreamStatus,
                                       UnitDeal, UnitResult, UnitTask)
from harvest.store.read.filters import RowFilter

SPEC = dict(index=1, model_path="/models/m", engine_kwargs={"backend": "vllm", "dtype": "bf16"},
            points=("resid_post.0", "resid_post.3"), context_size=128, store_url="s3://b/run",
            storage_options={"key": "k"}, threads=2, threads_requested=None, check_model=False,
            env={"HF_HOME": "/h"}, engine_factory="pkg.mod:Engine", factory_options={"x": 1},
            generate={"max_new_tokens": 4, "seed": 1}, stream=None)
TASK = dict(unit_id=7, row_start=256, row_end=512, pieces=((0, 1, 0, 2, 10),), refs=("ref",),
            digests=((1, 2, 3),), deal=None)
RESULT = dict(unit_id=7, row_start=256, row_end=512, actor=1, pid=4242, attempt=2,
              status="committed", tokens=256, seconds=1.5, capture_seconds=1.25,
              marker={"unit_id": 7, "shards": []}, rows_with_activations=200)
DEAL = dict(kept_before=1000, kept=250, cut=1249, ranks=(1,), replay=True)
INFO = dict(name="s", world_size=2, actors=("a0", "a1"), points=("resid_post.3",), widths=(576,),
            dtype="bfloat16", context_size=128, sink_positions=2, filter={"exclude_token_ids": [1]},
            tee=None)
STATUS = dict(units_planned=8, units_done=3, done=False, kept_rows=None, error=None, summary=None)
CASES = [(ActorSpec, SPEC), (UnitTask, TASK), (UnitResult, RESULT), (UnitDeal, DEAL),
         (StreamInfo, INFO), (StreamStatus, STATUS)]
IDS = [c.__name__ for c, _ in CASES]


@pytest.mark.parametrize("cls,fields", CASES, ids=IDS)
@pytest.mark.parametrize("pickler", [pickle, cloudpickle], ids=["pickle", "cloudpickle"])
def test_round_trips_through_pickle(cls, fields, pickler):
    m = cls(**fields)
    back = pickler.loads(pickler.dumps(m))
    assert type(back) is cls and back == m
    assert dataclasses.asdict(back) == fields  # every field set, none added on the way


@pytest.mark.parametrize("cls,fields", CASES, ids=IDS)
def test_unknown_and_missing_fields_fail_at_construction(cls, fields):
    with pytest.raises(TypeError, match="unexpected keyword argument 'unit_idd'"):
        cls(**fields, unit_idd=3)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        with pytest.raises(TypeError, match=f"missing 1 required .*'{name}'"):
            cls(**{k: v for k, v in fields.items() if k != name})


@pytest.mark.parametrize("cls,fields", CASES, ids=IDS)
def test_messages_are_frozen_and_slotted(cls, fields):
    m = cls(**fields)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(m, dataclasses.fields(cls)[0].name, 3)
    assert not hasattr(m, "__dict__")


@pytest.mark.parametrize("cls,fields,bad,match", [
    (ActorSpec, SPEC, {"points": ["resid_post.0"]}, "ActorSpec.points must be a non-empty tuple"),
    (ActorSpec, SPEC, {"points": ()}, "ActorSpec.points must be a non-empty tuple"),
    (ActorSpec, SPEC, {"context_size": 0}, "ActorSpec.context_size must be positive"),
    (ActorSpec, SPEC, {"engine_factory": "pkg.mod.Engine"}, "'module:callable'"),
    (UnitTask, TASK, {"row_end": 255}, "row_end 255 < row_start 256"),
    (UnitTask, TASK, {"refs": ()}, "1 pieces, 0 refs and 1 digests"),
    (UnitResult, RESULT, {"status": "done"}, "UnitResult.status must be one of"),
    (UnitDeal, DEAL, {"kept": -1}, "UnitDeal: kept_before=1000 and kept=-1 must be >= 0"),
    (ActorSpec, SPEC, {"store_url": None}, "no store_url and no stream"),
], ids=["points-list", "points-empty", "context", "factory", "rows", "refs", "status", "deal",
        "nowhere"])
def test_bad_values_fail_at_construction_naming_the_field(cls, fields, bad, match):
    with pytest.raises(ValueError, match=match):
        cls(**{**fields, **bad})


def test_unit_done_event_keeps_its_fields():
    """The driver's `unit_done` event carries what the result dict carried, marker left out."""
    keys = ["unit_id", "row_start", "row_end", "actor", "pid", "attempt", "status", "tokens",
            "seconds"]
    done = UnitResult(**RESULT).event()
    assert list(done) == keys + ["capture_seconds"]
    assert done["capture_seconds"] == 1.25 and done["status"] == "committed"
    found = UnitResult(**{**RESULT, "status": "already_committed", "tokens": 0, "seconds": 0.0,
                          "capture_seconds": None, "marker": None}).event()
    assert list(found) == keys
    json.dumps([done, found])


def test_cluster_builds_a_spec_from_a_config():
    from harvest.pipeline.driver.cluster import actor_spec
    from harvest.pipeline.config.run import load_config

    cfg = load_config(data={"model": {"path": "tiny:llama"}, "store": {"url": "/tmp/x.zarr"},
                            "ray": {"num_actors": 2}})
    from harvest.engine.addresses import Address

    addresses = (Address("resid_post", 0), Address("mlp_act", 1))   # parsed once, by prepare
    prep = SimpleNamespace(model_path="/m", points=["resid_post.0", "mlp_act.1"],
                           addresses=addresses)
    spec = actor_spec(cfg, prep, 0, "pkg.mod:Engine")
    assert isinstance(spec, ActorSpec)
    assert spec.points == addresses and spec.engine_kwargs.get("freeze_points") in (None, list(addresses))
    assert spec.engine_factory == "pkg.mod:Engine"
    assert spec.context_size == cfg.packing.context_size and spec.store_url.endswith("x.zarr")
    assert spec.check_model is (cfg.capture.check_model and cfg.model.backend == "vllm")
    assert actor_spec(cfg, prep, 1).check_model is False
    assert cloudpickle.loads(cloudpickle.dumps(spec)) == spec


@pytest.mark.parametrize("pickler", [pickle, cloudpickle], ids=["pickle", "cloudpickle"])
def test_stream_messages_round_trip_and_check_their_shapes(pickler):
    spec = StreamSpec(2, (0, 2), (576, 1536), "float8_e4m3fn",
                      RowFilter.build([1], 128, slice(2, None)), 4096)
    back = pickler.loads(pickler.dumps(spec))
    assert back == spec and back.filter.kept_positions() == spec.filter.kept_positions()
    with pytest.raises(ValueError, match="one width per streamed point"):
        StreamSpec(2, (0, 2), (576,), "bfloat16", spec.filter, 1)
    rows = StreamRows(actor=0, pid=1, parts=np.array([[3, 0, 2, 2, 6], [3, 1, 2, 0, 7]]),
                      rows=np.array([5, 7]), token_id=np.array([1, 2], np.int32),
                      doc_id=np.array([9, 9]), position=np.array([5, 7], np.int32),
                      acts=(np.zeros((2, 1, 8), np.uint16), np.zeros((0, 1, 8), np.uint16)))
    got = pickler.loads(pickler.dumps(rows))
    assert np.array_equal(got.rows, rows.rows) and got.acts[0].shape == (2, 1, 8)
    with pytest.raises(ValueError, match="parts count 3 rows, 2 given"):
        StreamRows(actor=0, pid=1, parts=np.array([[3, 0, 2, 3, 6]]), rows=rows.rows,
                   token_id=rows.token_id, doc_id=rows.doc_id, position=rows.position,
                   acts=rows.acts)
