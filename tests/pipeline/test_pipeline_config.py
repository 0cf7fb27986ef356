"""Run configs: YAML + overrides, validated up front, errors that name the field and the fix."""

from __future__ import annotations

import pytest

from harvest.pipeline.config.run import ConfigError, default_config_path, load_config
from harvest.store.storage.credentials import redact_url


def test_default_config_loads_and_names_the_offline_defaults():
    cfg = load_config(default_config_path())
    assert cfg.model.path == "smollm2"
    assert cfg.data.source == "pydoc"
    assert "{cache}" in cfg.store.url and not cfg.store.resolved_url.startswith("{")
    assert cfg.ray.actor_num_cpus < 1  # fractional CPUs: two actors must fit on two cores


def test_overrides_parse_yaml_values_and_nest():
    cfg = load_config(default_config_path(), ["packing.context_size=256", "ray.num_actors=1",
                                              "model.engine_args={max_num_seqs: 8}",
                                              "capture.points=[resid_post.1, resid_post.3]"])
    assert cfg.packing.context_size == 256 and cfg.ray.num_actors == 1
    assert cfg.model.engine_args == {"max_num_seqs": 8}
    assert cfg.capture.points == ["resid_post.1", "resid_post.3"]


def test_engine_kwargs_pass_through_and_freeze_the_capture_points():
    cfg = load_config(data={"model": {"backend": "vllm", "max_num_batched_tokens": 1024,
                                      "engine_args": {"max_num_seqs": 8}}})
    kw = cfg.model.engine_kwargs(["resid_post.0", "resid_post.2"])
    assert kw["freeze_points"] == ["resid_post.0", "resid_post.2"]
    assert kw["max_num_batched_tokens"] == 1024 and kw["max_num_seqs"] == 8
    hooked = load_config(data={"model": {"enforce_eager": True}}).model.engine_kwargs(["resid_post.0"])
    assert "freeze_points" not in hooked and hooked["enforce_eager"] is True


def test_model_level_points_may_be_named_bare():
    cfg = load_config(data={"capture": {"points": ["resid_post.*", "logprob", "entropy"]}})
    assert cfg.capture.parsed == (("resid_post", None), ("logprob", 0), ("entropy", 0))


@pytest.mark.parametrize(
    "data, match",
    [
        ({"packing": {"context_size": "128"}}, r"packing.context_size must be an integer"),
        ({"packing": {"contxt_size": 12}}, r"unknown field packing.contxt_size: did you mean packing.context_size"),
        ({"modle": {}}, r"unknown field modle: did you mean model"),
        ({"model": {"backend": "tgi"}}, r"model.backend='tgi' is not one of vllm, eager"),
        ({"capture": {"points": ["resid_post"]}}, r"capture.points entry 'resid_post'.*resid_post.3"),
        ({"capture": {"points": []}}, r"capture.points must be a non-empty list"),
        ({"ray": {"num_actors": 0}}, r"ray.num_actors must be >= 1"),
        ({"model": {"enforce_eager": True, "freeze_points": "auto"}}, r"model.enforce_eager.*model.freeze_points"),
        ({"store": {"shard_rows": 256, "chunk_rows": 100}}, r"store.chunk_rows=100 must divide store.shard_rows=256"),
        ({"model": {"engine_args": {"dtype": "float16"}}}, r"model.engine_args repeats \['dtype'\]"),
        ({"model": {"gpu_memory_utilization": 2}}, r"model.gpu_memory_utilization must be between"),
        ({"capture": {"points": ["resid_post.*", "logprob"], "generate": {"max_new_tokens": 4}}},
         r"\['logprob'\] with capture.generate.*prompts only"),
    ],
)
def test_bad_fields_are_named_with_a_fix(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data=data)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("packing: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not 'section.field=value'"):
        load_config(overrides=["packing.context_size"])


def test_credentials_never_reach_the_dumped_config():
    cfg = load_config(data={"store": {"url": "s3://AKIA:sekrit@bucket/x",
                                      "storage_options": {"secret": "sekrit"}}})
    dumped = str(cfg.to_dict())
    assert "sekrit" not in dumped and "AKIA" not in dumped
    assert redact_url("s3://bucket/x") == "s3://bucket/x"


def test_actor_resources_one_gpu_per_actor_on_gpu_clusters_fractional_cpu_otherwise():
    cfg = load_config(default_config_path())
    assert cfg.ray.actor_resources({"CPU": 2.0}) == (0.5, 0.0)
    assert cfg.ray.actor_resources({"CPU": 64.0, "GPU": 8.0}) == (1.0, 1.0)
    pinned = load_config(data={"ray": {"num_gpus_per_actor": 0, "num_cpus_per_actor": 2}})
    assert pinned.ray.actor_resources({"GPU": 8.0}) == (2.0, 0)


def test_the_engine_and_the_pipeline_agree_on_a_cache_under_home(tmp_path, monkeypatch):
    """HARVEST_CACHE='~/hc' (quoted in a YAML env, so no shell expands it): the engine made a
    literal ./~/hc while the pipeline used $HOME/hc."""
    from harvest.engine.models import cache_dir as engine_cache
    from harvest.pipeline.config.paths import cache_dir as pipeline_cache, expand_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HARVEST_CACHE", "~/hc")
    monkeypatch.chdir(tmp_path)
    want = tmp_path / "home" / "hc"
    assert pipeline_cache() == want and not want.exists()   # the pipeline names it only
    assert engine_cache() == want and want.is_dir()         # the engine creates it
    assert expand_path("{cache}/stores/x") == str(want / "stores" / "x")
    assert not (tmp_path / "~").exists()


def test_importing_the_config_imports_no_zarr_torch_or_ray():
    """`import harvest.pipeline.config.run` (every CLI command, every Ray worker) must not pay for the
    store's zarr/numcodecs (~500 modules: one re-export of redact_url pulled them in) or the
    engine's torch. Validating a store section still loads the codecs it names."""
    import subprocess
    import sys

    code = ("import sys, harvest.pipeline.config.run, harvest.pipeline.config.sections; "
            "print(sorted(m for m in ('zarr', 'numcodecs', 'torch', 'ray', 'vllm') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
