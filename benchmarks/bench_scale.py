"""Scale: the driver and the bookkeeping at 1 M-100 M tokens and 1 k-100 k units.

    .venv/bin/python -m harvest.benchmarks.bench_scale                       # everything, local + S3
    .venv/bin/python -m harvest.benchmarks.bench_scale --only driver --tokens 1e6 1e7 1e8

Sections (each row says what it measured):
- driver: a full `harvest.pipeline.driver.run.run` over a local corpus built from text already on the machine
  (the Python standard library's and site-packages' .py/.txt/.rst/.md files, /usr/share/doc),
  tokenised with SmolLM2's tokenizer by 2 workers, captured by one actor whose engine is a stub
  (zeros of a 16-wide, 1-layer model: the measured quantity is the driver and the bookkeeping,
  not the engine). Driver peak RSS (VmHWM of the driver process) and time from `run()` to the
  first committed unit.
- tokenise: tokens/s of the tokenising workers alone on the same corpus, 1, 2 and 4 workers.
- bookkeeping: a store with N committed units (synthetic layout-3 markers and object tables: 30
  points, width 64, one shard per unit, a stats sidecar object per unit, the index as a running driver
  leaves it: `commits.index_batch` segments, the markers since the last one unindexed), local and SeaweedFS on 127.0.0.1: time and
  peak RSS of the resume decision, `status`, `verify` (markers and plan; the synthetic store has
  no shard objects, so the per-object size check is left out) and `finalize`, each in a fresh
  process.
- shape: the same bookkeeping at Llama-3.1-8B's shape (32 points x 4096, 512 shards a unit) at
  1,000-3,815 units (3,815 = 10^9 tokens): marker, table and index bytes, time and peak RSS to
  open the store for reading, resume, status, verify and finalize, and the growth law
  extrapolated to 10^9 and 10^10 tokens (benchmarks/scale_shape.py; issue 24).
- dispatch: the driver's scheduling loop handing pre-planned units to stub actors that return at
  once: units/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .scale_shape import TABLES as SHAPE_TABLES
from .scale_shape import UNITS_PER_1B, read_open_child, shape_rows, table_child
from ..engine.protocol import CaptureOnly

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = (".py", ".txt", ".rst", ".md")


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cache() -> Path:
    from ..pipeline.config.paths import cache_dir

    return cache_dir()


# ---- corpus and model ------------------------------------------------------------------------

def text_roots() -> list[Path]:
    import site
    import sysconfig

    roots = [Path(sysconfig.get_paths()["stdlib"])]
    roots += [Path(p) for p in site.getsitepackages()]
    roots.append(Path("/usr/share/doc"))
    return [r for r in roots if r.is_dir()]


def build_corpus(target_bytes: int, out: Path | None = None) -> Path:
    """jsonl parts of ~32 MB, one document per text file, in sorted path order (deterministic);
    built once and reused (the part count says how much text there is)."""
    out = out or _cache() / "bench-corpus"
    done = out / "DONE.json"
    if done.is_file() and json.loads(done.read_text())["bytes"] >= target_bytes:
        return out
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("part-*.jsonl"):
        p.unlink()
    total, part, f = 0, 0, None
    for root in text_roots():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(TEXT_SUFFIXES):
                    continue
                try:
                    text = (Path(dirpath) / name).read_text("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if not text.strip():
                    continue
                if f is None or f.tell() > 32 << 20:
                    if f is not None:
                        f.close()
                    f = open(out / f"part-{part:04d}.jsonl", "w", encoding="utf-8")
                    part += 1
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                f.write(line)
                total += len(line.encode())
                if total >= target_bytes:
                    break
            if total >= target_bytes:
                break
        if total >= target_bytes:
            break
    if f is not None:
        f.close()
    done.write_text(json.dumps({"bytes": total, "parts": part}))
    return out


def scale_model(out: Path | None = None) -> str:
    """A model dir with SmolLM2's tokenizer and a 1-layer, 16-wide config: what the stub engine
    claims to be (no weights: the stub never loads any)."""
    out = out or _cache() / "bench-scale-model"
    if (out / "config.json").is_file():
        return str(out)
    from ..engine.models import smollm2_path

    src = Path(smollm2_path())
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=8)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


class StubEngine(CaptureOnly):
    """Stands in for the engine: zeros for every requested row, no model. Loaded by the actor
    through `engine_factory`; the driver, tokenisers, writer and commits are all the real ones.
    A harvest.engine.protocol.CaptureEngine (tests/engine/test_engine_protocol.py checks it); its steps
    are full ones of `max_num_batched_tokens`."""

    backend = "stub"
    accepts_destinations = False
    frozen = None
    revision = None

    def __init__(self, spec):
        from ..engine.checkpoint import read_model_info

        self.name = spec.model_path
        self.info = read_model_info(spec.model_path)
        self.n_layers, self.width = self.info.n_layers, self.info.width
        self.max_model_len, self.max_num_batched_tokens = self.info.max_position, 8192
        self.scheduled_tokens = 0
        import torch

        self.dtype = torch.bfloat16

    def describe(self) -> dict:
        return {"backend": "stub", "mode": "zeros", "width": self.width, "n_layers": self.n_layers}

    def step_stats(self) -> dict:
        return {"steps": -(-self.scheduled_tokens // self.max_num_batched_tokens),
                "scheduled_tokens": self.scheduled_tokens,
                "max_num_batched_tokens": self.max_num_batched_tokens}

    def capture(self, batches, points, destinations=None, quantize=None):
        if destinations is not None or quantize is not None:
            raise ValueError("the stub engine takes no destinations and does not quantise")
        return self._capture(batches, points)

    def _capture(self, batches, points):
        import numpy as np
        import torch

        from ..engine.addresses import parse_addresses
        from ..engine.capture.captured import CapturedRequest

        pts = tuple(parse_addresses(list(points), self.n_layers))
        zeros = None
        i = 0
        for batch in batches:
            for toks in batch:
                ids = np.asarray(toks, np.int32)
                if zeros is None or zeros.shape[1] != len(ids):
                    zeros = torch.zeros(len(pts), len(ids), self.width, dtype=self.dtype)
                self.scheduled_tokens += len(ids)
                yield CapturedRequest(i, ids, np.arange(len(ids), dtype=np.int32), pts, zeros)
                i += 1

    def close(self) -> None:
        pass


# ---- a Ray head for the whole benchmark --------------------------------------------------------

class Head:
    def __enter__(self):
        import secrets

        from tests.fixtures.ray_cluster import LOOPBACK_ENV, _gcs_up, _wait_ready, start_head

        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), **LOOPBACK_ENV}
        self.proc, self.log, self.tmp, self.address, _ = start_head(self.env, "hvbench-", False,
                                                                     num_cpus=os.cpu_count() or 2)
        _wait_ready(self.proc, self.tmp, _gcs_up(self.address), "ray start --head")
        return self

    def __exit__(self, *exc):
        from tests.fixtures.ray_cluster import _stop

        _stop(self.proc)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _child(args: list[str], env: dict | None = None, timeout: int = 3600) -> dict:
    r = subprocess.run([sys.executable, "-m", "harvest.benchmarks.bench_scale", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"bench_scale child {args[:2]} failed ({r.returncode}): {r.stderr[-3000:]}")
    return json.loads(lines[-1])


def _child_json(flag: str, spec: dict) -> dict:
    """`_child` with its spec as a JSON file (scale_shape's calls)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="harvest-bench-")
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    try:
        return _child([flag, path])
    finally:
        os.unlink(path)


# ---- driver ------------------------------------------------------------------------------------

def driver_child(spec: dict) -> dict:
    from ..pipeline.config.run import load_config
    from ..pipeline.driver.run import run

    cfg = load_config(data=spec["config"])
    t0 = time.perf_counter()
    first = []

    def hook(e):
        if e["event"] == "unit_done" and e.get("status") == "committed" and not first:
            first.append(time.perf_counter() - t0)

    s = run(cfg, on_event=hook, engine_factory="harvest.benchmarks.bench_scale:StubEngine")
    return {"tokens": s["tokens"], "units": s["units"], "blocks": s["blocks"],
            "first_commit_s": round(first[0], 2) if first else None,
            "wall_s": round(time.perf_counter() - t0, 1), "driver_peak_rss_mb": round(_peak_rss_mb(), 1),
            "tok_s": s["tokens_per_second"]}


def driver_rows(sizes, workdir: Path, head: Head, corpus: Path, model: str) -> list[dict]:
    rows = []
    for n in sizes:
        conf = {"name": "scale", "progress": False,
                "model": {"path": model, "backend": "eager"},
                "data": {"source": str(corpus / "part-*.jsonl")},
                "packing": {"context_size": 128, "max_tokens": int(n)},
                "capture": {"points": ["resid_post.0"]},
                "store": {"url": str(workdir / f"driver-{int(n)}")},
                "ray": {"address": head.address, "num_actors": 1, "tokenize_workers": 2}}
        spec = workdir / f"driver-{int(n)}.json"
        spec.write_text(json.dumps({"config": conf}))
        row = {"mode": "driver", "tokens_target": int(n),
               **_child(["--driver-child", str(spec)], env=head.env)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        shutil.rmtree(workdir / f"driver-{int(n)}", ignore_errors=True)
    if rows:
        base = rows[0]["driver_peak_rss_mb"]
        for r in rows:
            r["rss_vs_first"] = round(r["driver_peak_rss_mb"] / base, 3)
    return rows


# ---- tokenisation ------------------------------------------------------------------------------

def tokenize_child(spec: dict) -> dict:
    """Every chunk of the first `blocks` blocks through `workers` tokenising workers."""
    import ray

    from ..pipeline.config.run import load_config
    from ..pipeline.driver.prepare import prepare
    from ..pipeline.data.tokenpool import Job, TokenPool, env_for_workers

    ray.init(address=spec["address"])
    cfg = load_config(data=spec["config"])
    prep = prepare(cfg)
    jobs = [Job(b) for b in range(min(spec["blocks"], len(prep.sources["blocks"])))]
    pool = TokenPool.start(cfg.data, cfg.packing, cfg.ray, prep, jobs, None,
                           cfg.packing.chunk_tokens // 128, None, env_for_workers())
    ray.get([w.ping.remote() for w in pool.workers])  # tokenizers loaded: time the work alone
    t0 = time.perf_counter()
    tokens = 0
    while pool.active or pool.jobs:
        pool.fill(0, 1 << 62)
        ready, _ = ray.wait([j.gen for j in pool.active.values()], num_returns=1)
        item = pool.take(pool.job_of(ready[0]))
        if item is not None:
            tokens += item[1]["stats"]["tokens_seen"]
    secs = time.perf_counter() - t0
    pool.close()
    return {"workers": len(pool.workers), "tokens": tokens, "seconds": round(secs, 2),
            "tok_s": round(tokens / secs)}


def tokenize_rows(workers, workdir: Path, head: Head, corpus: Path, model: str, blocks: int) -> list:
    rows = []
    for w in workers:
        conf = {"model": {"path": model, "backend": "eager"},
                "data": {"source": str(corpus / "part-*.jsonl"), "block_bytes": 4 << 20},
                "packing": {"context_size": 128}, "capture": {"points": ["resid_post.0"]},
                "ray": {"tokenize_workers": w}}
        spec = workdir / f"tok-{w}.json"
        spec.write_text(json.dumps({"config": conf, "address": head.address, "blocks": blocks}))
        row = {"mode": "tokenise", **_child(["--tokenize-child", str(spec)], env=head.env)}
        row["cores"] = os.cpu_count()
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# ---- bookkeeping -------------------------------------------------------------------------------

P, W, SHARD = 30, 64, 128


def synthetic_store(url: str, so: dict | None, n_units: int) -> dict:
    """A store with n_units committed one-shard units as a running driver leaves it
    (scale_shape.synthetic_bookkeeping at P points x W wide, SHARD-row units)."""
    from .scale_shape import synthetic_bookkeeping

    return synthetic_bookkeeping(url, so, n_units, P, W, SHARD, 1)


def bookkeeping_child(spec: dict) -> dict:
    from types import SimpleNamespace

    from ..store import open_store

    url, so, op = spec["url"], spec.get("storage_options"), spec["op"]
    t0 = time.perf_counter()
    if op == "resume":
        from ..pipeline.driver.resume import resume_state

        s = open_store(url, storage_options=so)
        n = spec["units"]
        prep = SimpleNamespace(sources={"blocks": [[{}]] * n}, context_size=128,
                               layout=SimpleNamespace(unit_contexts=spec.get("unit_contexts", 1)))
        st = resume_state(s, prep, None)
        out = {"todo": len(st.todo), "committed": len(st.committed)}
    elif op == "status":
        from ..pipeline.cli.views import status

        view = status(url, so)
        out = {"committed": view["committed_units"]}
    elif op == "verify":
        v = open_store(url, storage_options=so).verify(objects=False)
        out = {"committed": v.committed_units, "ok": v.ok}
    elif op == "raw_get":
        # what finalize cannot avoid: one GET per unit's stats sidecar (batched the same way)
        from ..store.format import layout

        s = open_store(url, storage_options=so)
        keys = [s.location.key(layout.stats_key(u, "synthetic")) for u in range(spec["units"])]
        n = 0
        for i in range(0, len(keys), 256):
            n += sum(len(b) for b in s.location.read_many(keys[i:i + 256], "raw get").values())
        out = {"bytes": n}
    else:
        f = open_store(url, storage_options=so).finalize({"bench": True})
        out = {"committed": f["committed_units"]}
    return {**out, "seconds": round(time.perf_counter() - t0, 3), "peak_rss_mb": round(_peak_rss_mb(), 1)}


def bookkeeping_rows(sizes, storages, workdir: Path) -> list[dict]:
    rows = []
    srv = None
    try:
        for where in storages:
            so = None
            if where == "s3":
                import s3fs

                from ..testing import seaweed

                srv = srv or seaweed.start()
                s3fs.S3FileSystem(skip_instance_cache=True, **srv.storage_options).mkdir("bench")
                so = srv.storage_options
            for n in sizes:
                url = (f"s3://bench/book-{n}-{time.time_ns()}" if where == "s3"
                       else str(workdir / f"book-{n}"))
                t0 = time.perf_counter()
                synthetic_store(url, so, n)
                build = time.perf_counter() - t0
                for op in ("resume", "status", "verify", "raw_get", "finalize"):
                    spec = workdir / f"book-{op}.json"
                    spec.write_text(json.dumps({"url": url, "storage_options": so, "op": op,
                                                "units": n}))
                    r = _child(["--bookkeeping-child", str(spec)])
                    row = {"mode": f"bookkeeping {op.replace('raw_get', 'raw sidecar GETs')}",
                           "storage": where, "units": n,
                           "points": P, "seconds": r["seconds"],
                           "ms_per_unit": round(1000 * r["seconds"] / n, 4),
                           "peak_rss_mb": r["peak_rss_mb"], "build_s": round(build, 1)}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    rows.append(row)
                if where == "local":
                    shutil.rmtree(url, ignore_errors=True)
    finally:
        if srv is not None:
            srv.stop()
    return rows


# ---- dispatch ----------------------------------------------------------------------------------

class StubActor:
    def __init__(self, index: int):
        self.index = index

    def info(self):
        from ..pipeline.messages import ActorInfo

        return ActorInfo(index=self.index, pid=os.getpid(), host="", gpus=[], n_layers=0, width=0,
                         max_model_len=0, dtype="", describe={}, load_seconds=0.0, threads=1,
                         platform="", check=None, queue_tokens=0)

    def run_unit(self, unit, attempt: int = 1):
        from ..pipeline.messages import UnitResult

        return UnitResult(unit_id=unit.unit_id, row_start=unit.row_start, row_end=unit.row_end,
                          actor=self.index, pid=os.getpid(), attempt=attempt, status="committed",
                          tokens=unit.n_rows, seconds=0.0)

    def ping(self) -> int:
        return os.getpid()

    def figures(self):
        return None   # no engine: the driver's tally reports no step figures


def dispatch_child(spec: dict) -> dict:
    from types import SimpleNamespace

    import ray

    from ..pipeline.config.run import load_config
    from ..pipeline.driver.dispatch import Scheduler
    from ..pipeline.messages import UnitTask
    from ..pipeline.data.row_frontier import Frontier
    from ..pipeline.driver.resume import ResumeState
    from ..store.commit.plan import Unit

    if not ray.is_initialized():  # the suite's toy run calls this in its own connected process
        ray.init(address=spec["address"])
    n_actors, n_units = spec["actors"], spec["units"]
    cfg = load_config(data={"ray": {"num_actors": n_actors, "max_in_flight": 2}})
    prep = SimpleNamespace(layout=SimpleNamespace(unit_rows=1 << 18),
                           context_size=cfg.packing.context_size)
    f = Frontier(128, 2048, 0)
    f.done = True
    state = ResumeState([], set(), [], {}, f)
    pool = SimpleNamespace(active={}, fill=lambda *a: None, waitables=lambda *a: [],
                           blocks_tokenised=[])
    seen = []  # unit ids as the scheduler reports them done: each exactly once, none missing
    sched = Scheduler(cfg.ray, prep, state, pool,
                      lambda e: seen.append(e["unit_id"]) if e.get("event") == "unit_done" else None)
    Remote = ray.remote(StubActor)
    actors = [Remote.options(num_cpus=0.001).remote(i) for i in range(n_actors)]
    infos = ray.get([a.info.remote() for a in actors])
    sched.attach(None, actors, infos)
    sched.units.ready.extend((Unit(i, i * 256, (i + 1) * 256), 1) for i in range(n_units))
    bar = SimpleNamespace(update=lambda n: None)
    # the floor: the same calls on the same actors with no scheduler at all (2 per actor in flight)
    t0, cpu0 = time.perf_counter(), time.process_time()
    inflight, sent, got = {}, 0, 0
    while got < n_units:
        for a in actors:
            while sent < n_units and sum(x is a for x in inflight.values()) < 2:
                inflight[a.run_unit.remote(UnitTask(sent, 0, 1))] = a
                sent += 1
        ready, _ = ray.wait(list(inflight), num_returns=1)
        more, _ = ray.wait([r for r in inflight if r not in ready], num_returns=len(inflight) - 1,
                           timeout=0) if len(inflight) > 1 else ([], [])
        for r in ray.get(ready + more) and (ready + more):
            del inflight[r]
            got += 1
    bare_s, bare_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    t0, cpu0 = time.perf_counter(), time.process_time()
    while not sched.finished():
        sched.step(bar)
    secs = time.perf_counter() - t0
    done = sum(f["units"] for f in sched.report().per_actor)
    cpu = 1000 * (time.process_time() - cpu0) / done
    return {"actors": n_actors, "units": done, "seconds": round(secs, 2),
            "done_once": sorted(seen) == list(range(n_units)),
            "units_per_s": round(done / secs), "driver_cpu_ms_per_unit": round(cpu, 3),
            "driver_bound_units_per_s": round(1000 / cpu),
            "bare_ray_units_per_s": round(n_units / bare_s),
            "bare_ray_cpu_ms_per_unit": round(1000 * bare_cpu / n_units, 3),
            "vs_bare_ray": round(bare_s / secs, 3)}


def dispatch_rows(actor_counts, n_units: int, head: Head, workdir: Path) -> list[dict]:
    rows = []
    for n in actor_counts:
        spec = workdir / f"disp-{n}.json"
        spec.write_text(json.dumps({"address": head.address, "actors": n, "units": n_units}))
        row = {"mode": "dispatch", **_child(["--dispatch-child", str(spec)], env=head.env)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# ---- report ------------------------------------------------------------------------------------

def report_tables(rows: list[dict], md_table) -> list[str]:
    """Markdown: one table per kind of row (run_all's RESULTS.md section)."""
    groups = [("driver", "Driver: a full run over the local corpus, stub engine, 1 actor, 2 "
               "tokenising workers", ("tokens_target", "tokens", "units", "blocks",
                                      "driver_peak_rss_mb", "rss_vs_first", "first_commit_s",
                                      "wall_s")),
              ("tokenise", "Tokenisation alone (SmolLM2 tokenizer, 4 MiB blocks)",
               ("workers", "cores", "tokens", "seconds", "tok_s")),
              ("bookkeeping", "Bookkeeping on stores of synthetic committed units (30 points), "
               "each operation in a fresh process",
               ("mode", "storage", "units", "seconds", "ms_per_unit", "peak_rss_mb")),
              ("dispatch", "Dispatch to stub actors (the scheduler loop vs a bare Ray loop)",
               ("actors", "units", "units_per_s", "driver_cpu_ms_per_unit",
                "driver_bound_units_per_s", "bare_ray_units_per_s", "vs_bare_ray"))]
    groups += SHAPE_TABLES
    out = []
    for key, title, cols in groups:
        sel = [{c: r.get(c) for c in cols} for r in rows if r.get("mode", "").startswith(key)]
        if sel:
            out += [f"{title}:", "", md_table(sel, first=cols), ""]
    return out


# ---- suite entry -------------------------------------------------------------------------------

SECTIONS = ("driver", "tokenise", "bookkeeping", "shape", "dispatch")


def run(tokens=(1e6, 1e7, 1e8), workers=(1, 2, 4), units=(1000, 10000, 100000),
        storage=("local", "s3"), dispatch_actors=(8, 64), dispatch_units=5000,
        shape_units=(1000, 2000, UNITS_PER_1B),
        only=SECTIONS, workdir: str | None = None, tokenise_blocks: int = 8, **_ignored) -> list[dict]:
    """Result rows for the benchmark suite (see the module docstring)."""
    own = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="harvest-bench-scale-"))
    rows: list[dict] = []
    try:
        need_corpus = "driver" in only or "tokenise" in only
        corpus = build_corpus(int(max(tokens) * 4.2)) if need_corpus else None
        model = scale_model() if need_corpus else None
        if "bookkeeping" in only:
            rows += bookkeeping_rows(units, storage, work)
        if "shape" in only:
            rows += shape_rows(shape_units, work, _child_json)
        if {"driver", "tokenise", "dispatch"} & set(only):
            with Head() as head:
                if "dispatch" in only:
                    rows += dispatch_rows(dispatch_actors, dispatch_units, head, work)
                if "tokenise" in only:
                    rows += tokenize_rows(workers, work, head, corpus, model, tokenise_blocks)
                if "driver" in only:
                    rows += driver_rows(tokens, work, head, corpus, model)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def main(argv: "list[str] | None" = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, fn in (("--driver-child", driver_child), ("--tokenize-child", tokenize_child),
                     ("--bookkeeping-child", bookkeeping_child), ("--dispatch-child", dispatch_child),
                     ("--table-child", table_child), ("--read-open-child", read_open_child)):
        if argv[:1] == [flag]:
            print(json.dumps(fn(json.loads(Path(argv[1]).read_text()))))
            return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SECTIONS))
    p.add_argument("--tokens", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--units", nargs="+", type=int, default=[1000, 10000, 100000])
    p.add_argument("--storage", nargs="+", default=["local", "s3"])
    p.add_argument("--dispatch-actors", nargs="+", type=int, default=[8, 64])
    p.add_argument("--dispatch-units", type=int, default=5000)
    p.add_argument("--shape-units", nargs="+", type=int, default=[1000, 2000, UNITS_PER_1B],
                   help="unit counts of the 8B-shape bookkeeping stores (3,815 = 10^9 tokens)")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    rows = run(tokens=a.tokens, workers=a.workers, units=a.units, storage=a.storage,
               dispatch_actors=a.dispatch_actors, dispatch_units=a.dispatch_units,
               shape_units=a.shape_units,
               only=[s.strip() for s in a.only.split(",")])
    for r in rows:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
