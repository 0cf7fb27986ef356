"""Bad numbers and addresses are refused with the config, through `harvest plan`, in one line.

Once 8 of 34 bad values passed validation: NaN anywhere (NaN compares False with every bound),
inf on open-ended bounds, `store.shard_rows` that is not a multiple of the context size and an
unknown point kind. `store.lease_seconds: .nan` made the lease heartbeat spin (44 fsynced
rewrites in 2 s) and let a second driver take the live store.

The config below names a model that does not exist, so a value refused with the model's error
(or anything later) instead of its own field was not caught by config validation.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import typing

import pytest
import yaml

from harvest.pipeline.cli.main import main
from harvest.engine.models import REPO_ROOT
from harvest.pipeline.config.run import SECTIONS
from harvest.pipeline.driver.lease import Lease, refuse_if_held
from harvest.store.storage.locate import locate


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("cfg")
    p = d / "run.yaml"
    p.write_text(f"model: {{path: {d / 'no-such-model'}, backend: eager}}\n"
                 f"data: {{source: {d / 'docs.jsonl'}}}\n"
                 "packing: {context_size: 64, max_tokens: 4096}\n"
                 f"store: {{url: {d / 'store'}}}\nprogress: false\n")
    return str(p)


def _refused_line(capsys, config: str, *settings: str) -> str:
    """Run `harvest plan` in-process; it must exit 2 with exactly one line on stderr."""
    capsys.readouterr()
    argv = ["plan", "--config", config]
    for s in settings:
        argv += ["--set", s]
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and not out, (rc, out, err)
    prefix = "harvest plan: error: "
    assert lines[0].startswith(prefix), lines
    return lines[0][len(prefix):]


def test_the_config_is_refused_only_for_its_model(capsys, config):
    """The baseline the other tests rely on: valid settings get as far as the model."""
    assert _refused_line(capsys, config).startswith("model.path=")


@pytest.mark.parametrize("settings, field", [
    (["store.timeout_s=.nan"], "store.timeout_s"),
    (["store.lease_seconds=.nan"], "store.lease_seconds"),
    (["store.lease_seconds=.inf"], "store.lease_seconds"),
    (["ray.unit_timeout_s=.nan"], "ray.unit_timeout_s"),
    (["model.gpu_memory_utilization=.nan"], "model.gpu_memory_utilization"),
    (["ray.num_cpus_per_actor=.nan"], "ray.num_cpus_per_actor"),
    (["store.shard_rows=100"], "store.shard_rows"),
    (["capture.points=[resid_poop.3]"], "capture.points"),
    (["store.dtype=int8"], "store.dtype"),
    (["store.dtype=float16"], "store.dtype"),     # not the model's dtype: no silent cast
])
def test_issue_values_are_refused_by_harvest_plan(capsys, config, settings, field):
    assert _refused_line(capsys, config, *settings).startswith(field)


@pytest.mark.parametrize("setting, says", [
    ("capture.generate.max_new_tokens=0", "capture.generate.max_new_tokens must be >= 1"),
    ("capture.generate.max_new_tokens=64", "leaves no prompt in a packing.context_size=64 slot"),
    ("capture.generate.max_new_tokens=.nan", "capture.generate.max_new_tokens must be an integer"),
    ("capture.generate.temperature=-0.5", "capture.generate.temperature must be between 0"),
    ("capture.generate.temperature=.inf", "capture.generate.temperature must be between 0"),
    ("capture.generate.top_p=0", "capture.generate.top_p must be > 0"),
    ("capture.generate.top_p=1.5", "capture.generate.top_p must be between 0 and 1"),
    ("capture.generate.n=4", "n=4 x max_new_tokens=16 leaves no prompt in a "
                             "packing.context_size=64 slot"),
    ("capture.generate={n: 2, temperature: 0}", "greedy decoding samples the same text"),
    ("capture.generate.n=40000", "capture.generate.n must be <= 32767"),
    ("capture.generate.seed=-1", "capture.generate.seed must be >= 0"),
    ("capture.generate.stop=[hello]", "stop strings are not supported"),
    ("capture.generate.stop_at_eos=maybe", "capture.generate.stop_at_eos must be true or false"),
    ("capture.generate.keep_prompt=1", "capture.generate.keep_prompt must be true or false"),
    ("capture.generate.max_new=4", "unknown field capture.generate.max_new: did you mean "
                                   "capture.generate.max_new_tokens?"),
    ("capture.generate=32", "capture.generate must be a mapping"),
])
def test_bad_generation_settings_are_refused_naming_the_field(capsys, config, setting, says):
    msg = _refused_line(capsys, config, "model.backend=vllm", setting)
    assert msg.startswith("capture.generate") or msg.startswith("unknown field capture.generate")
    assert says in msg, msg


def test_an_fp8_store_gets_as_far_as_the_model(capsys, config):
    assert _refused_line(capsys, config, "store.dtype=float8_e4m3fn").startswith("model.path=")


def test_a_good_generation_section_gets_as_far_as_the_model(capsys, config):
    gen = "capture.generate={max_new_tokens: 16, temperature: 0.7, top_p: 0.9, seed: 3, " \
          "stop: [2], keep_prompt: false}"
    msg = _refused_line(capsys, config, "model.backend=vllm", gen)
    assert msg.startswith("model.path="), msg
    msg = _refused_line(capsys, config, gen)  # the eager reference captures prompts only
    assert msg.startswith("capture.generate needs model.backend: vllm"), msg
    # chat input completed by the model, n samples per prompt: both load (issue 26)
    msg = _refused_line(capsys, config, "model.backend=vllm", gen, "data.format=chat",
                        "data.messages_column=messages", "packing.bos=none",
                        "capture.generate.n=2", "capture.roles=[assistant]")
    assert msg.startswith("model.path="), msg
    msg = _refused_line(capsys, config, "model.backend=vllm", gen, "model.tensor_parallel_size=2",
                        "ray.num_gpus_per_actor=2")
    assert msg.startswith("capture.generate with model.tensor_parallel_size=2 is not supported"), msg


def test_shard_rows_and_points_errors_say_the_fix(capsys, config):
    msg = _refused_line(capsys, config, "store.shard_rows=100")
    assert "packing.context_size=64" in msg and "use 128 or 64" in msg
    msg = _refused_line(capsys, config, "capture.points=[resid_post.1, resid_poop.3]")
    assert "'resid_poop.3'" in msg and "resid_pre, attn_in, q, k, v, z, attn_out" in msg
    # points of other widths load (the store holds each at its own width) ...
    msg = _refused_line(capsys, config, "capture.points=[mlp_in.1, mlp_act.1, z.*, router_logits.*, "
                                        "q.1, k.*, v.0, mlp_pre.1, mlp_pre_linear.*]")
    assert msg.startswith("model.path="), msg
    # ... and the points no engine serves are refused by name
    msg = _refused_line(capsys, config, "capture.points=[lm_head.1]")
    assert "vocab-wide" in msg


def test_points_parsed_once_and_checked_against_the_model():
    """capture.points are parsed when the config is validated; prepare.resolve_points expands
    them into Addresses against the model and refuses, by name, a point the model lacks."""
    from harvest.engine.addresses import Address
    from harvest.engine.checkpoint import ModelInfo
    from harvest.pipeline.config.run import ConfigError, from_dict
    from harvest.pipeline.driver.prepare import resolve_points

    cap = from_dict({"capture": {"points": ["mlp_act.*", "mlp_in.1", "embeddings.*", "mlp_in.1"]}}).capture
    assert cap.parsed == (("mlp_act", None), ("mlp_in", 1), ("embeddings", None), ("mlp_in", 1))
    dense = ModelInfo(2, 64, 128, 100, 1, "LlamaForCausalLM", (("d_model", 64), ("heads", 64),
                                                                ("neurons", 256)))
    got = resolve_points(cap, 2, dense)
    assert got == (Address("mlp_act", 0), Address("mlp_act", 1), Address("mlp_in", 1),
                   Address("embeddings", 0))
    moe = ModelInfo(2, 64, 128, 100, 1, "Qwen3MoeForCausalLM", dense.kinds + (("experts", 8),))
    with pytest.raises(ConfigError, match="mlp_act is a dense MLP's point .*8 experts"):
        resolve_points(cap, 2, moe)
    router = from_dict({"capture": {"points": ["router_logits.0"]}}).capture
    assert resolve_points(router, 2, moe) == (Address("router_logits", 0),)
    with pytest.raises(ConfigError, match="router_logits.*needs a MoE model.*drop router_logits"):
        resolve_points(router, 2, dense)
    with pytest.raises(ConfigError, match="out of range: the model has layers 0..1"):
        resolve_points(from_dict({"capture": {"points": ["z.2"]}}).capture, 2, dense)


def test_real_cli_process_refuses_a_nan_lease(config):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-m", "harvest.pipeline.cli.main", "plan", "--config", config,
                        "--set", "store.lease_seconds=.nan"], capture_output=True, text=True,
                       cwd=REPO_ROOT, env=env, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("harvest plan: error: store.lease_seconds must be between 1 and ")
    assert line.endswith(", got nan")


# ------------------------------------------------------------------------------------------------
# Fuzz: every numeric field of every section, found from the dataclasses (new fields are covered)
# ------------------------------------------------------------------------------------------------

# Where 0 or -1 is a documented setting, not a mistake (-1: Ray's "retry for ever").
ZERO_OK = {"packing.bos_token_id", "store.stats_skip_positions", "ray.max_restarts",
           "ray.max_task_retries", "ray.num_cpus_per_actor", "ray.num_gpus_per_actor",
           "ray.tokenize_cpus", "stream.linger_s"}
MINUS_ONE_OK = {"ray.max_restarts", "ray.max_task_retries"}
NOT_NUMBERS = ["abc", "", "12", True, False, [1], {"a": 1}]
NON_FINITE = [math.nan, math.inf, -math.inf]


def numeric_fields() -> list[tuple[str, type]]:
    """(section.field, int or float) for every field typed int or float (optional or not)."""
    out = []
    for section, cls in SECTIONS.items():
        for name, hint in typing.get_type_hints(cls).items():
            args = typing.get_args(hint) or (hint,)
            kind = float if float in args else int if int in args else None
            if kind is not None:
                out.append((f"{section}.{name}", kind))
    return out


def bad_values(field: str, kind: type) -> list:
    vals = NOT_NUMBERS + NON_FINITE + [1e300, -1e300, -10**6, 10**30]
    if kind is int:
        vals += [2.5, 64.0]  # not integers, whatever their size
    if field not in ZERO_OK:
        vals += [0, 0.0] if kind is float else [0]
    if field not in MINUS_ONE_OK:
        vals += [-1]
    return vals


CASES = [(f, v) for f, kind in numeric_fields() for v in bad_values(f, kind)]


def test_fuzz_covers_every_section_and_enough_cases():
    fields = {f for f, _ in numeric_fields()}
    assert {f.split(".")[0] for f in fields} == set(SECTIONS)  # every section has some
    assert {"store.lease_seconds", "model.gpu_memory_utilization", "ray.unit_timeout_s",
            "packing.context_size"} <= fields
    assert len(CASES) >= 200, len(CASES)


def test_fuzz_every_bad_number_is_refused_in_one_line_naming_the_field(capsys, config):
    missed = []
    for field, value in CASES:
        text = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
        parsed = yaml.safe_load(text)
        # the override reaches the config as this very value (NaN is not equal to itself)
        assert type(parsed) is type(value) and (parsed == value or parsed != parsed), (value, text)
        msg = _refused_line(capsys, config, f"{field}={text}")
        if not msg.startswith(field):
            missed.append((field, value, msg))
    assert not missed, f"{len(missed)} of {len(CASES)} accepted or misnamed: {missed[:20]}"


# ------------------------------------------------------------------------------------------------
# The lease: the last guard, whatever its caller passes
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ttl", [math.nan, math.inf, 0.0, -5.0])
def test_lease_refuses_a_ttl_that_would_spin_its_heartbeat_or_never_expire(tmp_path, ttl):
    loc = locate(str(tmp_path / "store"))
    with pytest.raises(ValueError, match="store.lease_seconds must be a finite number > 0"):
        Lease(loc, ttl, "store", {"run": 1}, "a")
    with pytest.raises(ValueError, match="store.lease_seconds must be a finite number > 0"):
        refuse_if_held(loc, ttl, "store")
    assert not (tmp_path / "store").exists()
