"""`ray job submit` against `ray start --head` on 127.0.0.1 runs the entrypoint to completion.

The first submission is docs/operations.md's own block (the `export RAY_AUTH_MODE=token ...`
lines, run by bash), with only its placeholders filled in: the head's address, the cache folder, the
interpreter and the config path. It runs `python -m harvest.jobs.harvest --config run.yaml` inside the
cluster, and the store it leaves is checked from the test. Every address is this test's own head
(the shell's RAY_ADDRESS, the config's ray.address), so other Ray instances on the host do not
matter. A second submission of the finished config is a no-op that says so, and reusing a
submission id is refused by Ray (the guard against double submission).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from harvest.pipeline.config.paths import cache_dir
from harvest.engine.models import REPO_ROOT
from harvest.pipeline.config.run import default_config_path, load_config
from harvest.store import open_store
from tests.support.pipeline import make_cfg, write_corpus
from tests.support.readme import blocks

pytestmark = pytest.mark.slow  # a Ray head and `ray job submit`: not in `pytest -m 'not slow'`


def _client_env(head) -> dict:
    """The submitting shell's environment, bound to this test's head: other Ray instances on the
    host (other sessions' tests, a user's `ray start`) must not matter. Ray's CLI resolves an
    address it is not given from RAY_ADDRESS, else by scanning the host for GCS processes ("Found
    multiple active Ray instances" once there are two), and RAY_API_SERVER_ADDRESS / RAY_ADDRESS
    override even `--address`: all of them name this head here."""
    env = {**os.environ, **head.env}
    env["RAY_ADDRESS"] = env["RAY_API_SERVER_ADDRESS"] = head.dashboard_url
    return env


def _submit(head, sid: str, config: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    ray_bin = str(Path(sys.executable).with_name("ray"))
    cmd = [
        ray_bin, "job", "submit", "--address", head.dashboard_url, "--submission-id", sid,
        "--working-dir", str(REPO_ROOT),
        "--runtime-env-json", json.dumps({"env_vars": {"HARVEST_CACHE": str(cache_dir())}}),
        "--", sys.executable, "-m", "harvest.jobs.harvest", "--config", str(config),
    ]
    deadline = time.time() + 90
    while True:
        r = subprocess.run(cmd, env=_client_env(head), capture_output=True, text=True,
                           timeout=timeout, cwd=REPO_ROOT)
        # A fresh head answers HTTP before its job agent registers; the submission is refused
        # (nothing created) and may be repeated with the same id.
        if "No available agent" not in r.stderr + r.stdout or time.time() > deadline:
            return r
        time.sleep(2)


# the block's placeholders -> this test's values (each must be in the block: the page cannot drift)
def readme_submit(head, config: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    block = [b for b in blocks("bash") if "ray job submit" in b]
    assert len(block) == 1, "README.md and docs/ must hold one ray job submit block"
    script = block[0]
    subs = {"http://HEAD:8265": head.dashboard_url, "/shared/cache": str(cache_dir()),
            "/opt/harvest/.venv/bin/python": sys.executable,
            "jobs/configs/default.yaml": str(config)}
    for k, v in subs.items():
        assert k in script, f"docs/operations.md's ray job submit block no longer has {k!r}"
        script = script.replace(k, v)
    # the user's shell: the venv's `ray` on PATH, the head's token where `ray get-auth-token` reads
    # it; RAY_AUTH_MODE / RAY_AUTH_TOKEN come from the block's own export
    env = {k: v for k, v in _client_env(head).items() if k != "RAY_AUTH_MODE"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    deadline = time.time() + 90
    while True:
        r = subprocess.run(["bash", "-euc", script], env=env, capture_output=True, text=True,
                           timeout=timeout, cwd=REPO_ROOT)
        if "No available agent" not in r.stderr + r.stdout or time.time() > deadline:
            return r
        time.sleep(2)


def test_ray_job_submit_runs_the_entrypoint_to_completion(ray_head, tiny_llama, tmp_path):
    corpus = write_corpus(tmp_path / "docs.jsonl")
    store_dir = tmp_path / "store"
    cfg = make_cfg(tiny_llama, str(store_dir), corpus, "packing.max_tokens=2048")
    conf = cfg.to_dict(redact=False)
    # the cluster the job runs in, named: Ray's RAY_ADDRESS for the entrypoint is found from the
    # head's temp dir, or by "auto" (any GCS on the host) where that fails
    conf["ray"]["address"] = ray_head.address
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(conf))

    sid = f"harvest-test-{uuid.uuid4().hex[:8]}"
    r = readme_submit(ray_head, path)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "succeeded" in out, out[-4000:]
    assert "harvest test: 2048 tokens in 8 units (8 run, 0 already committed)" in out, out[-3000:]
    # the job log is the quiet console: harvest's lines, the log folder named once, no bar frames
    assert "logs: " in out and "Traceback" not in out and "it/s]" not in out, out[-3000:]

    store = open_store(str(store_dir))
    v = store.verify()
    assert v.ok and v.committed_units == 8, v
    assert store.summary["tokens"] == 2048 and len(store.summary["per_actor"]) == 2

    again = _submit(ray_head, sid, path)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "is already complete" in again.stdout + again.stderr
    dup = _submit(ray_head, sid, path, timeout=120)
    assert dup.returncode != 0 and "already exists" in (dup.stdout + dup.stderr)


def test_shipped_configs_load():
    cfg = load_config(default_config_path())
    assert cfg.model.path == "smollm2" and cfg.data.source == "pydoc"
    for p in sorted((REPO_ROOT / "jobs" / "configs").glob("*.yaml")):
        load_config(p)
