"""End to end: tokens/s from a dataset to a committed, verified store, beside the engine alone.

    flock /tmp/harvest-vllm.lock .venv/bin/python -m harvest.benchmarks.bench_e2e            # tiny llama
    flock /tmp/harvest-vllm.lock .venv/bin/python -m harvest.benchmarks.bench_e2e --model smollm2 \
        --max-tokens 16384 --context-size 128

One row per (storage, actors): local dir and SeaweedFS S3 on 127.0.0.1, 1 and 2 Ray actors, each
a full `harvest.pipeline.driver.run.run` (pack the pydoc corpus, plan, create the store, dispatch, commit,
verify, finalize). `tok_s` is committed tokens over the dispatch phase (actors loaded: the
steady state a long run sees); `wall_tok_s` includes actor start-up and store creation. In the
same run, before any actor starts, the freeze engine alone captures the *same* token ids in the
same batches in a fresh process (`engine_tok_s`, all cores), so `ratio_to_engine` compares like
with like on a shared machine whose speed drifts from hour to hour. Only one vLLM engine runs at a
time: the engine measurement ends (and its engine is closed) before the pipeline rows start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _engine_alone(model_path: str, engine_kwargs: dict, token_ids, context_size: int,
                  unit_rows: int, batch_contexts: int, points: list[str], workdir: str) -> dict:
    """The engine on the same contexts, in the same per-unit batches, results dropped.

    In a fresh process with every core (what one actor alone would get): an engine measured in a
    process where other engines ran before inherits their OpenMP binding and thread settings,
    which measured a third of the speed here.
    """
    import subprocess

    import numpy as np

    spec: dict[str, Any] = {"model_path": model_path, "engine_kwargs": engine_kwargs, "context_size": context_size,
            "unit_rows": unit_rows, "batch_contexts": batch_contexts, "points": points,
            "tokens": str(Path(workdir) / "engine_tokens.npy"), "threads": os.cpu_count() or 1}
    np.save(spec["tokens"], np.asarray(token_ids, dtype=np.int32))
    spec_path = Path(workdir) / "engine_spec.json"
    spec_path.write_text(json.dumps(spec))
    r = subprocess.run([sys.executable, "-m", "harvest.benchmarks.bench_e2e", "--engine-alone", str(spec_path)],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"engine-alone run failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(lines[-1])


def _engine_alone_child(spec_path: str) -> dict:
    import numpy as np
    import torch

    from ..engine import load_model

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    C, per_unit, bc = spec["context_size"], spec["unit_rows"] // spec["context_size"], spec["batch_contexts"]
    ctx = np.load(spec["tokens"]).reshape(-1, C).tolist()
    t0 = time.perf_counter()
    m = load_model(spec["model_path"], **spec["engine_kwargs"])
    load_s = time.perf_counter() - t0
    for _ in m.capture([ctx[: min(len(ctx), bc)]], spec["points"]):  # warm-up
        pass
    t0 = time.perf_counter()
    n = 0
    for u in range(0, len(ctx), per_unit):
        unit = ctx[u : u + per_unit]
        for req in m.capture([unit[i : i + bc] for i in range(0, len(unit), bc)], spec["points"]):
            n += len(req)
    secs = time.perf_counter() - t0
    mode = m.describe().get("mode")
    m.close()
    return {"tokens": n, "seconds": secs, "tok_s": n / secs, "load_s": load_s, "mode": mode}


def _ensure_loopback_ray(num_cpus: int | None):
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray reads that variable when imported (vLLM imports Ray early): set the constant it fed,
    # or 127.0.0.1 is rewritten to the interface address and every port listens on all of them.
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    # ray.init turns token auth on by default; a per-run token in the environment keeps it from
    # writing ~/.ray/auth_token. RAY_AUTH_MODE is left to ray.init, which re-reads its config:
    # setting it here would be missed by a Ray already imported (vLLM imports it).
    if "RAY_AUTH_MODE" not in os.environ and not (Path.home() / ".ray" / "auth_token").exists():
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
             _node_ip_address="127.0.0.1", object_store_memory=256 << 20,
             runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    return True


def run(model: str | None = None, backend: str = "vllm", context_size: int = 128,
        max_tokens: int = 32768, points=("resid_post.*",), storage=("local", "s3"),
        actors=(1, 2), batch_contexts: int = 64, max_batched: int | None = None,
        shard_rows: int | None = None, workdir: str | None = None, engine_baseline: bool = True,
        max_in_flight: int | None = None, **_ignored) -> list[dict]:
    """Result rows for the benchmark suite (see the module docstring for what is timed)."""
    import ray

    from ..pipeline.config.run import load_config
    from ..pipeline.data.documents import iter_texts
    from ..pipeline.driver.run import run as run_pipeline
    from ..pipeline.data.packing import pack_texts
    from ..pipeline.driver.prepare import prepare

    model = model or "tiny:llama"
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="harvest-bench-e2e-")
    base: dict[str, Any] = {
        "name": "bench",
        "progress": False,
        "model": {"path": model, "backend": backend},
        "data": {"source": "pydoc"},
        "packing": {"context_size": int(context_size), "max_tokens": int(max_tokens)},
        "capture": {"points": list(points), "batch_contexts": int(batch_contexts)},
        "store": {"url": "unused", "shard_rows": shard_rows},
        "ray": {"num_actors": 1},
    }
    if max_batched:
        base["model"]["max_num_batched_tokens"] = int(max_batched)
    rows: list[dict] = []
    seaweed = None
    started = False
    try:
        cfg0 = load_config(data=base)
        prep = prepare(cfg0)
        engine = None
        if engine_baseline:
            # the rows the pipeline packs from this one-block corpus (the pydoc topics)
            from transformers import AutoTokenizer

            packed = pack_texts(iter_texts(cfg0.data), AutoTokenizer.from_pretrained(prep.model_path),
                                cfg0.packing)
            engine = _engine_alone(prep.model_path, cfg0.model.engine_kwargs(prep.points),
                                   packed.token_ids, cfg0.packing.context_size,
                                   prep.layout.unit_rows, cfg0.capture.batch_contexts, prep.points,
                                   workdir)
            print(f"engine alone ({engine['mode']}): {engine['tokens']} tokens, "
                  f"{engine['tok_s']:.0f} tok/s", file=sys.stderr, flush=True)
        started = _ensure_loopback_ray(None)
        for where in storage:
            so = None
            if where == "s3":
                if seaweed is None:
                    import s3fs

                    from ..testing import seaweed as sw

                    seaweed = sw.start(nice=10)  # see seaweed.start: stands in for remote S3
                    s3fs.S3FileSystem(skip_instance_cache=True, **seaweed.storage_options).mkdir("bench")
                so = seaweed.storage_options
            for n in actors:
                url = (f"s3://bench/e2e-{n}-{time.time_ns()}" if where == "s3"
                       else str(Path(workdir) / f"e2e-{where}-{n}-{time.time_ns()}"))
                data = {**base, "store": {**base["store"], "url": url, "storage_options": so},
                        "ray": {"num_actors": int(n),
                                **({"max_in_flight": int(max_in_flight)} if max_in_flight else {})}}
                cfg = load_config(data=data)
                t0 = time.perf_counter()
                s = run_pipeline(cfg)
                wall = time.perf_counter() - t0
                row = {
                    "mode": "e2e", "storage": where, "backend": backend, "actors": int(n),
                    "model": Path(prep.model_path).name, "points": s["points"],
                    "tokens": s["tokens_this_run"], "tok_s": s["tokens_per_second"],
                    "wall_tok_s": round(s["tokens_this_run"] / wall, 1),
                    "dispatch_s": s["dispatch_seconds"], "wall_s": round(wall, 2),
                    "startup_s": round(wall - s["dispatch_seconds"], 2),
                    "compression": s["compression_ratio"],
                    "stored_mb": round(s["bytes_stored"] / 1e6, 2),
                    "per_actor_tok_s": [a["tokens_per_second"] for a in s["per_actor"]],
                    "verified": s["verified"]["ok"],
                }
                if engine:
                    row["engine_tok_s"] = round(engine["tok_s"], 1)
                    row["ratio_to_engine"] = round(s["tokens_per_second"] / engine["tok_s"], 3)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        if engine:
            rows.append({"mode": "engine alone", "backend": backend, "engine_mode": engine["mode"],
                         "tokens": engine["tokens"], "engine_tok_s": round(engine["tok_s"], 1),
                         "engine_load_s": round(engine["load_s"], 2)})
    finally:
        if started:
            ray.shutdown()
        if seaweed is not None:
            seaweed.stop()
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main(argv: "list[str] | None" = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--engine-alone"]:
        print(json.dumps(_engine_alone_child(argv[1])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny:llama", help="checkpoint dir, smollm2 or tiny:<arch>")
    p.add_argument("--backend", default="vllm", choices=("vllm", "eager"))
    p.add_argument("--context-size", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32768)
    p.add_argument("--points", nargs="+", default=["resid_post.*"])
    p.add_argument("--storage", nargs="+", default=["local", "s3"])
    p.add_argument("--actors", nargs="+", type=int, default=[1, 2])
    p.add_argument("--max-batched", type=int, default=None)
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="units queued per actor (default: the config's ray.max_in_flight)")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    rows = run(model=a.model, backend=a.backend, context_size=a.context_size,
               max_tokens=a.max_tokens, points=a.points, storage=a.storage, actors=a.actors,
               max_batched=a.max_batched, max_in_flight=a.max_in_flight)
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
