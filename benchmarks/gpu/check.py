"""The first GPU run, prepared: one command, under 8 minutes on one H100/H200.

    HARVEST_GPU=1 bash .ci/install           # once, on the GPU host (installs vllm==0.34.0)
    .venv/bin/python -m harvest.benchmarks.gpu.check  # prints the report, writes benchmarks/results/gpu_check.{json,md}

What it prints, each step in its own process (a GPU engine is never reused after close, and a
crash in one step is reported, not fatal). Every step runs on vLLM's Model Runner V2 (the only
runner of vLLM 0.34; `HARVEST_MODEL_RUNNER=v2` in each step's environment, and in the dry run on
CPU Triton's interpreter with it); where the installed vLLM still has V1, a last step runs the
tiny llama on V1 for comparison:
- engine:<model> for tiny llama, tiny qwen3 and SmolLM2: vLLM's cudagraph mode, capture sizes,
  async scheduling and AOT settings; the tap buffer NaN-poisoned before every step and no NaN
  delivered; resid_post at every layer against Hugging Face fp32 at 64 and 8,192 tokens per step
  (the first replays piecewise CUDA graphs, the second runs compiled without them); for SmolLM2
  also freeze tok/s;
- restart: tiny llama again in a fresh process (warm compile cache): bit-identical rows;
- plain: SmolLM2 without taps, same prompts: plain vs freeze tok/s;
- pipeline: a one-actor `harvest run` then `harvest verify --deep`, and host core-seconds (all
  processes, from /proc/stat) per captured GB;
- v1:tiny-llama: the first step on Model Runner V1, where vLLM has it (0.32, 0.33).

`--dry` (automatic without CUDA) runs the same orchestration on CPU with the tiny llama at 64
tokens per step and the eager pipeline; the CUDA-only checks report "skipped: no CUDA". The test
suite runs it, so the script cannot rot before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
MODELS = ("tiny-llama", "tiny-qwen3", "smollm2")
NO_CUDA = "skipped: no CUDA"


# -- child side: one check per process --------------------------------------------------------------

def _model_path(name: str) -> str:
    from ...engine.models import build_tiny_model, cache_dir, smollm2_path

    if name.startswith("tiny-"):
        arch = name.split("-", 1)[1]
        return build_tiny_model(cache_dir() / "models" / name, arch)
    return smollm2_path()


def _workloads(sizes, max_len: int, vocab: int) -> dict[int, list[list[int]]]:
    """Prompts whose steps carry `size` tokens: 64-token prompts one at a time, or enough
    full-length prompts to fill 8,192-token steps."""
    import random

    rng = random.Random(0)
    out = {}
    for s in sizes:
        n, length = (4, 64) if s <= 64 else (-(-2 * s // (max_len - 1)), max_len - 1)
        out[s] = [[rng.randrange(3, vocab - 3) for _ in range(length)] for _ in range(n)]
    return out


def _hf_errors(path, prompts, got, device) -> list[float]:
    """Worst relative error per layer against HF fp32 (last layer through the final norm)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    base = getattr(model, "model", None) or getattr(model, "transformer")
    norm = getattr(base, "norm", None) or getattr(base, "ln_f")
    worst: list[float] = []
    with torch.inference_mode():
        for p, acts in zip(prompts, got):
            hs = model(torch.tensor([p], device=device), output_hidden_states=True).hidden_states
            n = acts.shape[0]
            for L in range(n):
                x = acts[L].to(device).float()
                ref = hs[L + 1][0]
                if L == n - 1:
                    x = norm(x)
                e = float((x - ref).norm() / ref.norm())
                worst.append(e) if len(worst) <= L else worst.__setitem__(L, max(worst[L], e))
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return worst


def _capture(m, prompts, in_flight):
    """All layers of every prompt, in index order, with no NaN; and a digest of their bytes."""
    import torch

    got = [None] * len(prompts)
    for req in m.capture([prompts], None, max_in_flight_tokens=in_flight):
        if torch.isnan(req.acts).any():
            raise AssertionError(f"request {req.index}: NaN delivered: a tap did not write it")
        got[req.index] = req.acts
    h = hashlib.sha256()
    for a in got:
        h.update(a.contiguous().view(torch.int16).numpy().tobytes())
    return got, h.hexdigest()[:16]


def child_engine(model: str, sizes, dry: bool, compare_hf: bool, tok_s: bool) -> dict:
    import torch

    from ...engine import load_model
    from ...engine.checkpoint import read_model_info

    path = _model_path(model)
    info = read_model_info(path)
    max_len = min(info.max_position, 1024)
    work = _workloads(sizes, max_len, info.vocab_size)
    kw = {"max_num_batched_tokens": 64} if dry else {}
    t = time.perf_counter()
    m = load_model(path, backend="vllm", freeze_points="auto", freeze_writes=[],
                   max_model_len=max_len, **kw)
    out = {"model": model, "load_s": round(time.perf_counter() - t, 1),
           "settings": m.engine_settings(), "summary_before": m.state.summary()}
    m.set_poison(True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    per_size = {}
    got_all = {}
    for s, prompts in work.items():
        before = m.step_stats()
        got, digest = _capture(m, prompts, in_flight=s if s <= 64 else sum(map(len, prompts)))
        after = m.step_stats()
        steps = after["steps"] - before["steps"]
        per_size[s] = {"digest": digest, "steps": steps,
                       "tokens_per_step": round((after["scheduled_tokens"] - before["scheduled_tokens"])
                                                / max(1, steps), 1)}
        got_all[s] = (prompts, got)
    if tok_s:
        prompts = _workloads([8192], max_len, info.vocab_size)[8192] * 4
        out["freeze_tok_s"] = _best_tok_s(m, prompts)
    out["summary"] = m.state.summary()
    m.close()
    if compare_hf:  # after the engine is gone: HF and vLLM do not share the device's memory
        tol = 0.05 if model == "smollm2" else 0.03
        for s, (prompts, got) in got_all.items():
            worst = _hf_errors(path, prompts, got, device)
            per_size[s]["worst_rel_err_by_layer"] = [round(e, 4) for e in worst]
            per_size[s]["hf_ok"] = max(worst) < tol
    out["per_size"] = per_size
    out["ok"] = all(v.get("hf_ok", True) for v in per_size.values())
    return out


def _best_tok_s(m, prompts, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats + 1):
        t = time.perf_counter()
        for _req in m.capture([prompts], None if m.mode != "plain" else [],
                              max_in_flight_tokens=4 * m.max_num_batched_tokens):
            pass
        best = min(best, time.perf_counter() - t)
    return round(sum(map(len, prompts)) / best, 1)


def child_plain(model: str) -> dict:
    from ...engine import load_model
    from ...engine.checkpoint import read_model_info

    path = _model_path(model)
    info = read_model_info(path)
    max_len = min(info.max_position, 1024)
    m = load_model(path, backend="vllm", freeze_points=[], max_model_len=max_len)
    prompts = _workloads([8192], max_len, info.vocab_size)[8192] * 4
    out = {"model": model, "plain_tok_s": _best_tok_s(m, prompts), "ok": True}
    m.close()
    return out


CHILDREN: dict[str, Callable[..., dict]] = {"engine": child_engine, "plain": child_plain}


# -- the pipeline step (subprocesses of its own) ----------------------------------------------------

def _cpu_jiffies() -> int | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        vals = list(map(int, fields))
        return sum(vals) - vals[3] - vals[4]  # everything but idle and iowait
    except Exception:
        return None


def pipeline_step(dry: bool, timeout: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="harvest-gpucheck-"))
    store = tmp / "store"
    if dry:
        sets = ["model.path=tiny:llama", "model.backend=eager", "packing.context_size=64",
                "packing.max_tokens=4096", "ray.local_num_cpus=2"]
    else:
        sets = ["model.path=smollm2", "model.backend=vllm", "packing.context_size=1024",
                "packing.max_tokens=131072", "capture.batch_contexts=64"]
    sets += ["ray.num_actors=1", f"store.url={store}", "progress=false"]
    cmd = [sys.executable, "-m", "harvest.pipeline.cli.main", "run", "--config",
           str(REPO / "jobs" / "configs" / "default.yaml"), "--json"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           **runner_env()}
    j0, t0 = _cpu_jiffies(), time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    wall, j1 = time.perf_counter() - t0, _cpu_jiffies()
    out = {"command": " ".join(cmd), "wall_s": round(wall, 1), "ok": r.returncode == 0}
    if r.returncode != 0:
        out["error"] = (r.stderr or r.stdout)[-1500:]
        return out
    text = r.stdout
    # `run --json` prints only the JSON (a log line of Ray's may still precede it)
    summary = json.loads(text[text.index("{"):]) if "{" in text else {}
    gb = summary.get("bytes_logical", 0) / 1e9
    out.update(tokens=summary.get("tokens_this_run"), tok_s=summary.get("tokens_per_second"),
               captured_gb=round(gb, 3), compression=summary.get("compression_ratio"))
    if j0 is not None and j1 is not None and gb:
        core_s = (j1 - j0) / os.sysconf("SC_CLK_TCK")
        out["host_core_s_per_gb"] = round(core_s / gb, 1)
        out["host_core_s_note"] = "whole host, all processes (/proc/stat): run it on an idle host"
    v = subprocess.run([sys.executable, "-m", "harvest.pipeline.cli.main", "verify", str(store), "--deep", "--json"],
                       capture_output=True, text=True, timeout=max(30.0, timeout - wall), cwd=REPO,
                       env=env)
    out["verify_deep"] = "OK" if v.returncode == 0 else f"FAILED: {(v.stdout or v.stderr)[-800:]}"
    out["ok"] = v.returncode == 0
    return out


# -- orchestration ------------------------------------------------------------------------------------

def plan(dry: bool) -> list[dict]:
    """Steps in order, each with the seconds it may take on one H100/H200 (8 minutes in all)."""
    if dry:
        return [
            {"name": "engine:tiny-llama", "child": "engine", "s": 240,
             "args": {"model": "tiny-llama", "sizes": [64], "dry": True, "compare_hf": True,
                      "tok_s": False}},
            {"name": "engine:8192-tokens-per-step", "skip": NO_CUDA + " (dry mode runs 64 per step)"},
            {"name": "engine:tiny-qwen3", "skip": NO_CUDA},
            {"name": "engine:smollm2", "skip": NO_CUDA},
            {"name": "restart:tiny-llama", "child": "engine", "s": 180, "same_as": "engine:tiny-llama",
             "args": {"model": "tiny-llama", "sizes": [64], "dry": True, "compare_hf": False,
                      "tok_s": False}},
            {"name": "plain:smollm2", "skip": NO_CUDA},
            {"name": "pipeline", "pipeline": True, "s": 240},
            _v1_step(dry=True),
        ]
    return [
        {"name": "engine:tiny-llama", "child": "engine", "s": 90,
         "args": {"model": "tiny-llama", "sizes": [64, 8192], "dry": False, "compare_hf": True,
                  "tok_s": False}},
        {"name": "engine:tiny-qwen3", "child": "engine", "s": 75,
         "args": {"model": "tiny-qwen3", "sizes": [64, 8192], "dry": False, "compare_hf": True,
                  "tok_s": False}},
        {"name": "engine:smollm2", "child": "engine", "s": 110,
         "args": {"model": "smollm2", "sizes": [64, 8192], "dry": False, "compare_hf": True,
                  "tok_s": True}},
        {"name": "restart:tiny-llama", "child": "engine", "s": 45, "same_as": "engine:tiny-llama",
         "args": {"model": "tiny-llama", "sizes": [64, 8192], "dry": False, "compare_hf": False,
                  "tok_s": False}},
        {"name": "plain:smollm2", "child": "plain", "s": 60, "args": {"model": "smollm2"}},
        {"name": "pipeline", "pipeline": True, "s": 70},
        _v1_step(dry=False),
    ]


def _v1_step(dry: bool) -> dict:
    """The tiny llama on Model Runner V1, after every V2 step, where vLLM still ships V1."""
    if not has_v1():
        return {"name": "v1:tiny-llama", "skip": "skipped: this vLLM has no Model Runner V1"}
    return {"name": "v1:tiny-llama", "child": "engine", "runner": "v1", "s": 180 if dry else 30,
            "args": {"model": "tiny-llama", "sizes": [64] if dry else [64, 8192], "dry": dry,
                     "compare_hf": True, "tok_s": False}}


def runner_env(runner: str = "v2") -> dict:
    """The environment of a step on vLLM's Model Runner `runner`; V2 without CUDA (the dry run)
    runs its kernels in Triton's interpreter (testing/triton_interpreter.py)."""
    import torch

    env = {"HARVEST_MODEL_RUNNER": runner}
    if runner == "v2" and not torch.cuda.is_available():
        env.update(HARVEST_TRITON_INTERPRET="1", TRITON_INTERPRET="1")
    return env


def has_v1() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def run_child(step: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "harvest.benchmarks.gpu.check", "--child", step["child"],
           "--args", json.dumps(step["args"])]
    env = {**os.environ, "PYTHONPATH": str(REPO), **runner_env(step.get("runner", "v2"))}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        return {"ok": False, "error": f"exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def check(dry: bool, budget: float = 480.0) -> list[dict]:
    t_end = time.perf_counter() + budget
    results: list[dict] = []
    by_name: dict[str, dict] = {}
    for step in plan(dry):
        left = t_end - time.perf_counter()
        row = {"name": step["name"]}
        if "skip" in step:
            row.update(status=step["skip"])
        elif left < 20:
            row.update(status="skipped: out of time")
        else:
            t = time.perf_counter()
            res = pipeline_step(dry, left) if step.get("pipeline") else run_child(step, left)
            row.update(res, seconds=round(time.perf_counter() - t, 1), budget_s=step["s"])
            ref = by_name.get(step.get("same_as", ""))
            if ref is not None and res.get("per_size"):
                same = all(res["per_size"][s]["digest"] == ref["per_size"][s]["digest"]
                           for s in res["per_size"] if s in ref.get("per_size", {}))
                row["bit_identical_to_first_start"] = same
                row["ok"] = row.get("ok", False) and same
            row["status"] = "ok" if row.get("ok") else "FAILED"
        by_name[step["name"]] = row
        results.append(row)
        print(format_row(row), flush=True)
    freeze = by_name.get("engine:smollm2", {}).get("freeze_tok_s")
    plain = by_name.get("plain:smollm2", {}).get("plain_tok_s")
    if freeze and plain:
        results.append({"name": "freeze/plain", "status": "ok", "ratio": round(freeze / plain, 3)})
        print(format_row(results[-1]), flush=True)
    return results


def format_row(r: dict) -> str:
    keys = ("settings", "per_size", "load_s", "freeze_tok_s", "plain_tok_s", "ratio",
            "bit_identical_to_first_start", "tok_s", "captured_gb", "host_core_s_per_gb",
            "verify_deep", "seconds", "error")
    detail = {k: r[k] for k in keys if k in r}
    return f"[{r['status']}] {r['name']}" + (f": {json.dumps(detail, default=str)}" if detail else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="CPU dry run (automatic without CUDA)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all steps (8 min)")
    ap.add_argument("--out", default=None, help="directory for gpu_check.json/.md "
                    "(default benchmarks/results on a GPU, nothing in a dry run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        res = CHILDREN[a.child](**json.loads(a.args))
        print("RESULT " + json.dumps(res, default=str), flush=True)
        return 0
    import torch

    dry = a.dry or not torch.cuda.is_available()
    print(f"gpu_check: {'dry run on CPU' if dry else torch.cuda.get_device_name()}, "
          f"budget {a.budget:.0f} s", flush=True)
    t = time.perf_counter()
    results = check(dry, a.budget)
    total = round(time.perf_counter() - t, 1)
    failed = [r["name"] for r in results if r["status"] == "FAILED"]
    print(f"gpu_check: {len(failed)} failed {failed} in {total} s", flush=True)
    out = a.out or (None if dry else str(REPO / "benchmarks" / "results"))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        doc = {"dry": dry, "seconds": total, "results": results}
        Path(out, "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str))
        Path(out, "gpu_check.md").write_text("\n".join(format_row(r) for r in results) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
