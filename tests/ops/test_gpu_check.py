"""benchmarks/gpu/check.py cannot rot before a GPU is at hand: its dry mode runs here, on CPU.

The dry run starts two vLLM engines one after the other (the check and its warm restart) and a
one-actor eager pipeline: run this file under `flock /tmp/harvest-vllm.lock`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harvest.benchmarks.gpu import check as gpu_check

# the GPU check's dry run (engines, a pipeline run): not in `pytest -m 'not slow'`
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_gpu_plan_covers_the_issue_and_fits_eight_minutes():
    steps = gpu_check.plan(dry=False)
    names = [s["name"] for s in steps]
    assert {f"engine:{m}" for m in gpu_check.MODELS} <= set(names)
    assert {"restart:tiny-llama", "plain:smollm2", "pipeline"} <= set(names)
    assert all(s["args"]["sizes"] == [64, 8192] for s in steps if s["name"].startswith("engine:"))
    assert sum(s["s"] for s in steps) <= 480
    assert steps[-1]["name"] == "v1:tiny-llama" and all(s.get("runner", "v2") == "v2" for s in steps[:-1])
    # every CUDA-only step of the dry plan says so instead of vanishing
    dry = gpu_check.plan(dry=True)
    assert {s["name"] for s in dry} >= set(names)
    assert all(s["skip"].startswith(gpu_check.NO_CUDA) for s in dry if "skip" in s)


def test_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    r = subprocess.run([sys.executable, "-m", "harvest.benchmarks.gpu.check", "--dry", "--budget", "600",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=900,
                       cwd=REPO, env=env)
    out = r.stdout
    assert r.returncode == 0, out[-4000:] + r.stderr[-4000:]
    assert "[skipped: no CUDA] engine:smollm2" in out and "[skipped: no CUDA] plain:smollm2" in out
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in doc["results"]}
    eng = rows["engine:tiny-llama"]
    assert eng["status"] == "ok" and eng["settings"]["compilation_mode"] != "0"
    assert {"cudagraph_mode", "cudagraph_capture_sizes", "async_scheduling", "aot_compile"} <= set(eng["settings"])
    assert eng["settings"]["v2_model_runner"] is True   # V2 first, then V1 where vLLM has it
    v1 = rows["v1:tiny-llama"]
    assert v1["status"] == "ok" and v1["settings"]["v2_model_runner"] is False
    assert v1["per_size"]["64"]["hf_ok"]
    size = eng["per_size"]["64"]
    assert size["hf_ok"] and len(size["worst_rel_err_by_layer"]) == 4
    assert size["tokens_per_step"] == 64.0
    assert rows["restart:tiny-llama"]["bit_identical_to_first_start"] is True
    pipe = rows["pipeline"]
    assert pipe["status"] == "ok" and pipe["verify_deep"] == "OK" and pipe["captured_gb"] > 0
    assert pipe["host_core_s_per_gb"] > 0
