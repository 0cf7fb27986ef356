"""Engine start: first start (empty compile cache) against later starts that reuse it.

Each start is a fresh process (as a new job's actor is), timed from before `load_model` to the
first captured request, on one compile cache folder shared by all of them (as `compat.
compile_cache_environment` shares `$HARVEST_CACHE/compile` across runs and actors):

  cold      empty cache folder: dynamo traces, inductor compiles
  warm      the same folder again: the compiled graphs are loaded
  warm-cpu1 again, with the OpenMP threads bound to another core, as a second actor on the same
            host has them (does the cache carry across actors?)
  eager     compilation_config mode 0 (no torch.compile), the floor

    flock /tmp/harvest-vllm.lock .venv/bin/python -m harvest.benchmarks.bench_start [--model smollm2]

Writes benchmarks/results/start.json; RESULTS.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from harvest.engine import load_model
kw = json.loads(sys.argv[2])
m = load_model(sys.argv[1], backend="vllm", freeze_points="auto", **kw)
t1 = time.perf_counter()
next(iter(m.capture([[[1, 504, 2231, 88] * 16]], points=["resid_post.3"])))
t2 = time.perf_counter()
print("RESULT", json.dumps({"load_s": round(t1 - t0, 2), "first_capture_s": round(t2 - t1, 2),
                            "start_s": round(t2 - t0, 2)}))
"""


def one_start(model: str, cache: Path, extra_env: dict, engine_kw: dict) -> dict:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), **extra_env}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _CHILD, model, json.dumps(engine_kw)], env=env,
                       capture_output=True, text=True, timeout=900,
                       cwd=Path(__file__).resolve().parent.parent)
    wall = time.perf_counter() - t
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        raise RuntimeError(f"start failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return {**json.loads(line[0][7:]), "process_s": round(wall, 2)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=str(RESULTS / "start.json"))
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    out = {"model": args.model, "cores": len(cores), "starts": {}}
    with tempfile.TemporaryDirectory(prefix="harvest-start-") as d:
        cache = Path(d)
        bind0 = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[0]), "OMP_NUM_THREADS": "1"}
        bind1 = {"VLLM_CPU_OMP_THREADS_BIND": str(cores[-1]), "OMP_NUM_THREADS": "1"}
        plan = [("cold", bind0, {}), ("warm", bind0, {}), ("warm-cpu1", bind1, {}),
                ("eager", bind0, {"compilation_config": {"mode": 0}})]
        for name, env, kw in plan:
            out["starts"][name] = r = one_start(args.model, cache, env, kw)
            print(f"{name:10s} start {r['start_s']:6.1f} s (load {r['load_s']:.1f} s, first "
                  f"capture {r['first_capture_s']:.1f} s; process {r['process_s']:.1f} s)",
                  flush=True)
        files = [f for f in cache.rglob("*") if f.is_file()]
        out["cache_mb"] = round(sum(f.stat().st_size for f in files) / 1e6, 1)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
