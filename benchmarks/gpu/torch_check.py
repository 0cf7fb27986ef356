"""What torch alone can prove on a GPU host without vLLM, Ray or zarr of its own (issue 28).

    bash benchmarks/gpu/torch_check.sh            # here: builds .gpu-wheels/ (zarr & co, < 64 MiB)
    # on the GPU host, from the checkout root (the exact command: docs/benchmarks.md):
    pip install --no-index --find-links .gpu-wheels zarr==3.1.6 ... && \\
        PYTHONPATH=. python benchmarks/gpu/torch_check.py --out $OUT

Four parts, each in its own process (a CUDA error or a crash in one is reported, not fatal to the
others), within one budget (default 480 s on one H200):

1. taps: harvest's freeze taps in a compiled 1.4 B Llama trunk replayed as CUDA graphs, every
   tapped row against an eager reference, and the taps' step-time overhead (torch_taps.py);
2. transport: the real CudaTransport on an 8B-shaped step loop: no torn or stale row, D2H GB/s
   against the pinned peak, main-stream stall per step (torch_transport.py);
3. writer: host core-seconds per captured GB, the rate the node's cores sustain (torch_store.py);
4. reader: the SAE reader feeding a TopK SAE trained on the GPU, against the SAE's demand.

`--dry` (automatic without CUDA) runs every part on CPU at tiny shapes through the same code;
what needs CUDA is reported as "skipped: needs CUDA", never as a pass. tests/ops/test_gpu_torch_check.py
runs it. Output: gpu_torch_check.json and gpu_torch_check.md in `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):   # run as a file (the GPU host has no install): import from the checkout
    sys.path.insert(0, str(REPO))

NEEDS_CUDA = "skipped: needs CUDA"
# (part, seconds it may take on one H200): the cheap, certain parts first, so a compile that
# overruns the budget costs only its own part; taps get what is left.
PARTS = (("transport", 130), ("writer", 100), ("reader", 100), ("taps", 450))


def run_part(name: str, dry: bool) -> dict:
    if name == "taps":
        from . import torch_taps
        return torch_taps.run(dry, replays=2 if dry else 6, reps=3 if dry else 20)
    if name == "transport":
        from . import torch_transport
        return torch_transport.run(dry)
    from . import torch_store
    return torch_store.writer(dry) if name == "writer" else torch_store.reader(dry)


def child(name: str, dry: bool, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "harvest.benchmarks.gpu.torch_check", "--child", name]
    if dry:
        cmd.append("--dry")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-1500:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-1500:]
        return {"status": "FAILED", "error": f"timed out after {timeout:.0f} s", "tail": str(tail)}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        return {"status": "FAILED", "error": f"exit {r.returncode}: {(r.stderr or r.stdout)[-3000:]}"}
    res = json.loads(lines[-1][len("RESULT "):])
    res.setdefault("status", "ok" if res.get("ok") else "FAILED")
    res["part_s"] = round(time.perf_counter() - t, 1)
    return res


def summarize(parts: dict) -> dict:
    """The cross-part ratio: what the node's cores can write against what the transport delivers."""
    out: dict[str, object] = {}
    tr, wr = parts.get("transport", {}), parts.get("writer", {})
    delivered = (tr.get("staging") or {}).get("achieved_d2h_gbs")
    sustained = wr.get("sustained_gbs_at_all_cores")
    if isinstance(delivered, (int, float)) and isinstance(sustained, (int, float)):
        out["writer_sustained_over_transport"] = round(sustained / delivered, 3)
        out["note"] = ("> 1: the node's cores write captured rows faster than one GPU's transport "
                       "delivers them (one GPU per node; divide by GPUs per node)")
    return out


def _flat(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flat(v, f"{prefix}{k}.")
        elif k not in ("status", "ok"):
            out.append((prefix + k, v))
    return out


def markdown(doc: dict) -> str:
    lines = [f"# gpu_torch_check ({'dry run on CPU' if doc['dry'] else doc['device']})", "",
             f"{doc['date']}, torch {doc['torch']}, {doc['seconds']} s"]
    for name, res in doc["parts"].items():
        lines += ["", f"## {name}: {res['status']}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {json.dumps(v, default=str)[:300]} |" for k, v in _flat(res)]
    if doc["summary"]:
        lines += ["", "## summary", ""] + [f"- {k}: {v}" for k, v in doc["summary"].items()]
    return "\n".join(lines) + "\n"


def check(dry: bool, budget: float) -> dict:
    import torch

    t_end = time.perf_counter() + budget
    parts = {}
    for name, cap in PARTS:
        left = t_end - time.perf_counter()
        if left < 20:
            parts[name] = {"status": "skipped: out of time"}
        else:
            parts[name] = child(name, dry, min(left, cap) if name != "taps" else left)
        print(f"[{parts[name]['status']}] {name}: {json.dumps(parts[name], default=str)[:600]}",
              flush=True)
    return {"dry": dry, "device": "cpu" if dry else torch.cuda.get_device_name(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "parts": parts, "summary": summarize(parts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for gpu_torch_check.json and .md (required unless --child)")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes (automatic without CUDA)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for all parts (8 minutes)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import torch

    dry = a.dry or not torch.cuda.is_available()
    if a.child:
        res = run_part(a.child, dry)
        print("RESULT " + json.dumps(res, default=str), flush=True)
        return 0
    if not a.out:
        ap.error("--out FOLDER is required: the JSON and markdown reports go there")
    print(f"gpu_torch_check: {'dry run on CPU' if dry else torch.cuda.get_device_name()}, "
          f"budget {a.budget:.0f} s", flush=True)
    t = time.perf_counter()
    doc = check(dry, a.budget)
    doc["seconds"] = round(time.perf_counter() - t, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_torch_check.json").write_text(json.dumps(doc, indent=2, default=str))
    (out / "gpu_torch_check.md").write_text(markdown(doc))
    failed = [n for n, r in doc["parts"].items() if r["status"] == "FAILED"]
    print(f"gpu_torch_check: {len(failed)} failed {failed} in {doc['seconds']} s; wrote {out}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
