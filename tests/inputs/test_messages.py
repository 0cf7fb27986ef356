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

from harvest.pipeline.messages import ActorSpec, UnitResult, UnitTask

SPEC = dict(index=1, model_path="/models/m", engine_kwargs={"backend": "vllm", "dtype": "bf16"},
            points=("resid_post.0", "resid_post.3"), context_size=128, store_url="s3://b/run",
            storage_options={"key": "k"}, threads=2, threads_requested=None, check_model=False,
            env={"HF_HOME": "/h"}, engine_factory="pkg.mod:Engine", factory_options={"x": 1},
            generate={"max_new_tokens": 4, "seed": 1})
TASK = dict(unit_id=7, row_start=256, row_end=512, pieces=((0, 1, 0, 2, 10),), refs=("ref",),
            digests=((1, 2, 3),))
RESULT = dict(unit_id=7, row_start=256, row_end=512, actor=1, pid=4242, attempt=2,
              status="committed", tokens=256, seconds=1.5, capture_seconds=1.25,
              marker={"unit_id": 7, "shards": []}, rows_with_activations=200)
CASES = [(ActorSpec, SPEC), (UnitTask, TASK), (UnitResult, RESULT)]
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
], ids=["points-list", "points-empty", "context", "factory", "rows", "refs", "status"])
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
