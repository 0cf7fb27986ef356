"""Train a TopK SAE while the capture runs: the reader follows the store as units commit.

    python examples/train_while_capturing.py --config jobs/configs/tiny.yaml
    python examples/train_while_capturing.py --config jobs/configs/default.yaml --point resid_post.15 \\
        --compare 3

Starts `harvest run --config CONFIG` (a fresh store under --workdir; or `--store URL` follows a
store another run is writing, or has written), waits for its first commit
(the normalisation constants come from the rows committed by then), then trains the TopK SAE of
examples/train_topk.py on `ActivationDataset(store, follow=True, ...)`: batches arrive as units
commit, and the loop ends by itself when the run finalizes the store. It reports the held-out
FVU (5 % of the documents, split by doc_id) and how many units were committed when training
started and at each tenth of it.

`--compare N` then trains N more SAEs after the run, per seed: one on a follower of the
finished store (same rows in the same order as a live follower: the order is the plan's, never
the commits' timing, so seed 0 reproduces the live SAE exactly) and one on the plain shuffled
reader (one epoch), and prints both FVU spreads: training while capturing should land inside
the spread of training afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import REPO, recipe_kwargs
from train_topk import TopKSAE

from harvest.store import ActivationDataset, heldout_fvu, on_device, open_store, StoreError


def start_capture(config: str, url: str, sets: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "harvest.pipeline.cli.main", "run", "--config", config,
           "--set", f"store.url={url}", "--set", "progress=false"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_first_commit(url: str, proc: "subprocess.Popen | None", log: Path) -> None:
    while True:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the capture ended (rc {proc.returncode}) before its first commit; see {log}")
        try:
            if open_store(url, read_only=True).ledger.marker_names():
                return
        except StoreError:
            pass   # not created yet
        time.sleep(0.5)


def train(ds, args, seed: int, width: int, progress=None) -> tuple[TopKSAE, list[float]]:
    torch.manual_seed(seed)
    sae = TopKSAE(width, args.expansion * width, args.k)
    opt = torch.optim.Adam(sae.parameters(), lr=args.lr)
    losses = []
    for x in on_device(ds):
        loss = ((sae(x) - x) ** 2).sum(-1).mean() / width
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sae.normalize_decoder()
        losses.append(loss.item())
        if progress is not None:
            progress(len(losses))
    return sae, losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "jobs/configs/tiny.yaml"))
    ap.add_argument("--set", action="append", default=[], help="config override for the capture")
    ap.add_argument("--workdir", default=None, help="where the store goes (default: a temp dir)")
    ap.add_argument("--store", default=None, help="follow this store (a run writing it, or done) "
                    "instead of starting a capture")
    ap.add_argument("--point", default=None, help="default: the middle point of the store")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--window-rows", type=int, default=None,
                    help="shuffle_buffer_rows (default: the reader's 1 GiB of rows; a small store fits "
                         "in one such window, and a follower reads a window once all of it is committed)")
    ap.add_argument("--expansion", type=int, default=4)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--compare", type=int, default=0, help="seeds trained after the run, per mode")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="harvest-follow-"))
    work.mkdir(parents=True, exist_ok=True)
    url, log = args.store or str(work / "store"), work / "capture.log"
    t0 = time.perf_counter()
    proc = None if args.store else start_capture(args.config, url, args.set, log)
    wait_first_commit(url, proc, log)
    st = open_store(url, read_only=True)
    point = args.point or st.points[len(st.points) // 2]
    base = {**recipe_kwargs(st, 0), "points": point, "batch_size": args.batch_size,
            "shuffle_buffer_rows": args.window_rows}   # recipe: norm_scale, special tokens out
    base.pop("max_norm_ratio")   # a follower cannot take a whole-store norm sample
    live = ActivationDataset(url, follow=True, split="train", seed=0, **base)
    norm = live.norm_constants
    base["norm_constants"] = norm
    seen = {"start": len(st.ledger.marker_names())}
    timeline = []

    def progress(step: int) -> None:
        if step % 10 == 1:
            line = live.follow_line
            timeline.append((step, None if line is None or line.state is None else line.state.committed,
                             round(time.perf_counter() - t0, 1)))

    print(f"training on {point} while the capture runs ({seen['start']} units committed)", flush=True)
    sae, losses = train(live, args, 0, st.width, progress)
    rc = proc.wait() if proc is not None else 0
    if rc:
        raise SystemExit(f"the capture failed (rc {rc}); see {log}")
    seconds = time.perf_counter() - t0
    test = ActivationDataset(url, split="test", seed=0, shuffle=False, **base)
    fvu_live = heldout_fvu(sae, test)
    planned = len(open_store(url).ledger.plan_units())
    out = {"point": point, "steps": len(losses), "rows": len(losses) * args.batch_size,
           "units": planned, "committed_at_start": seen["start"], "heldout_fvu_live": fvu_live,
           "seconds": round(seconds, 1), "timeline": timeline, "norm_source": norm.source}
    if args.compare:
        follow_fvu, after_fvu = [], []
        for seed in range(args.compare):
            f_sae, f_losses = train(ActivationDataset(url, follow=True, split="train", seed=seed, **base),
                                    args, seed, st.width)
            if seed == 0:
                out["live_equals_finished_follower"] = f_losses == losses
            follow_fvu.append(heldout_fvu(f_sae, test))
            a_sae, _ = train(ActivationDataset(url, split="train", seed=seed, **base), args, seed, st.width)
            after_fvu.append(heldout_fvu(a_sae, test))
        out["heldout_fvu_follow"] = follow_fvu
        out["heldout_fvu_after"] = after_fvu
        for name, v in (("follow", follow_fvu), ("after", after_fvu)):
            out[f"{name}_mean"] = statistics.mean(v)
            out[f"{name}_std"] = statistics.stdev(v) if len(v) > 1 else 0.0
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
