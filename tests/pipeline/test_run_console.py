"""What `harvest run` prints: the quiet console (default), `--json`, and the budget warning.

The run is the CLI in a subprocess, as a user starts it, connected to the test cluster through
RAY_ADDRESS: its whole stdout + stderr is what a terminal (or a job log) would show. The tiny
eager config stands in for the default run (the vLLM one prints the same harvest lines plus the
engine phases; its output is pasted in docs/operations.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harvest.pipeline.cli.commands.run import budget_shortfall
from harvest.engine.models import REPO_ROOT
from harvest.store import open_store
from tests.support.pipeline import make_cfg, shared_corpus

pytestmark = pytest.mark.slow  # a CLI run in a subprocess: not in `pytest -m 'not slow'`

MAX_LINES = 25


def _cli(args: list[str], head, cache, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, **head.env, "RAY_ADDRESS": head.address, "HARVEST_CACHE": str(cache),
           "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "harvest.pipeline.cli.main", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_quiet_run_prints_a_short_console_and_keeps_the_rest_in_a_log_folder(
        ray_cluster, tiny_llama, tmp_path):
    corpus = shared_corpus(tmp_path / "corpus")
    cfg = make_cfg(tiny_llama, str(tmp_path / "store"), corpus, "packing.max_tokens=2048",
                   "ray.num_actors=1")
    conf = cfg.to_dict(redact=False)
    conf["progress"] = True  # a pipe: periodic lines, never bar frames
    conf["ray"]["address"] = None
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(conf))

    r = _cli(["run", "--config", str(path)], ray_cluster, tmp_path / "cache")
    console = r.stdout + r.stderr
    assert r.returncode == 0, console[-3000:]
    lines = console.splitlines()
    assert len(lines) <= MAX_LINES, console
    assert "Traceback" not in console and "WARNING" not in console, console
    assert lines[0].startswith("logs: ") and "harvest test: 2048 tokens in 8 units" in console
    # the run ends with its report written beside the data, and says where
    png = Path(cfg.store.resolved_url) / "_report" / "report.png"
    assert f"report: {png} (and " in console and png.stat().st_size > 10_000
    # ...and the dataset card written at finalize shows that picture (it said "No picture yet")
    card = (Path(cfg.store.resolved_url) / "README.md").read_text()
    assert "![harvest report](_report/report.png)" in card and "No picture yet" not in card
    log_dir = tmp_path / "cache" / "logs"
    (run_dir,) = list(log_dir.iterdir())
    assert str(run_dir) in lines[0]
    driver_log = (run_dir / "driver.log").read_text()
    # every unit's commit line went to the file, none to the console
    assert driver_log.count(" committed by actor ") == 8 and " committed by actor " not in console
    assert [p.name for p in run_dir.glob("actor-*.log")] == ["actor-0.log"]
    assert "harvest-phase: ready" in (run_dir / "actor-0.log").read_text()

    again = _cli(["run", "--config", str(path), "--json"], ray_cluster, tmp_path / "cache")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    s = json.loads(again.stdout)  # nothing but JSON on stdout
    assert s["noop"] is True and s["tokens"] == 2048 and s["warnings"] == []
    assert open_store(cfg.store.resolved_url).summary["tokens"] == 2048


def test_budget_shortfall_names_the_numbers(tiny_llama, tmp_path):
    cfg = make_cfg(tiny_llama, str(tmp_path / "s"), tmp_path / "d.jsonl",
                   "packing.max_tokens=5000000")
    short = {"tokens": 220_416, "packing": {"budget_reached": False}}
    assert budget_shortfall(cfg.packing, short) == (
        "packing.max_tokens=5,000,000 was not reached: the corpus gave 220,416 tokens (4.4% of "
        "the budget); add data or lower packing.max_tokens")
    assert budget_shortfall(cfg.packing, {"tokens": 5_000_000, "packing": {"budget_reached": True}}) is None
    assert budget_shortfall(cfg.packing, {**short, "noop": True}) is None


def test_start_watch_reports_the_slowest_actors_phase(tmp_path, monkeypatch):
    """Phases come from the actors' own log files: a line when the slowest actor moves on, a
    heartbeat otherwise, nothing in between."""
    from harvest.pipeline.logs import LOG_DIR_ENV, StartWatch

    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path))
    a0, a1 = tmp_path / "actor-0.log", tmp_path / "actor-1.log"
    w = StartWatch(2, t0=1000.0)  # heartbeat every 60 s
    a0.write_text("harvest-phase: engine pid 1\n"
                  "INFO [cpu_model_runner.py:68] Starting to load model x\n")
    a1.write_text("harvest-phase: engine pid 2\n")
    assert w.line(2, now=1005.0) == ("engines starting, 5 s: importing the engine (vLLM, torch) "
                                     "(1 of 2); loading weights (1 of 2)")
    assert w.line(2, now=1010.0) is None  # nothing new, no heartbeat due
    with open(a1, "a") as f:
        f.write("INFO Starting to load model x\nINFO Warming up model for the compilation...\n")
    assert w.line(2, now=1012.0) == ("engines starting, 12 s: loading weights (1 of 2); "
                                     "compiling (later starts reuse the compile cache) (1 of 2)")
    assert w.line(2, now=1060.0) is None
    assert w.line(2, now=1073.0).startswith("engines starting, 73 s: loading weights")  # heartbeat
