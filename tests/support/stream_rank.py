"""One trainer rank of a stream, for the stream tests: `read_rank` in a thread of the test process,
or this module as an external process that joins the stream through the Ray cluster's address
(`python -m tests.support.stream_rank SPEC_JSON`), as a trainer on another machine would."""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def options(opts: dict) -> dict:
    """JSON-able reader options -> keywords (seqpos as [start, stop])."""
    out = dict(opts)
    if isinstance(out.get("seqpos"), list):
        out["seqpos"] = slice(*out["seqpos"])
    return out


def read_rank(cfg, rank: int, world: int, opts: dict, on_batch=None, state=None) -> dict:
    """Every batch of rank `rank`: rows, metadata and acts' raw bits (float32 when normalised),
    with the stream's figures, description, state and constants. `state`: resume from it.
    `on_batch(i, ds, rows)`: after batch i, with the rows yielded so far."""
    import torch

    import harvest

    ds = harvest.stream(cfg, rank=rank, world_size=world, **options(opts))
    if state is not None:
        ds.load_state_dict(state)
    rows, tok, doc, pos, acts = [], [], [], [], []
    for i, b in enumerate(ds):
        rows.append(b["row"].numpy().copy())
        tok.append(b["token_id"].numpy().copy())
        doc.append(b["doc_id"].numpy().copy())
        pos.append(b["position"].numpy().copy())
        a = b["acts"]
        acts.append((a.view(torch.int16) if a.dtype == torch.bfloat16 else a).numpy().copy())
        if on_batch is not None:
            on_batch(i, ds, rows)
    st = ds.receiver.last_status if ds.receiver is not None else None
    return {"rows": np.concatenate(rows), "token_id": np.concatenate(tok),
            "doc_id": np.concatenate(doc), "position": np.concatenate(pos),
            "acts": np.concatenate(acts), "batches": len(rows), "figures": ds.figures(),
            "describe": ds.describe(), "state": ds.state_dict(),
            "summary": st.summary if st is not None else None}


def main(argv: list[str]) -> int:
    import ray

    from harvest.pipeline.config.run import load_config

    spec = json.loads(argv[0])
    ray.init(address=spec["address"], log_to_driver=False)
    cfg = load_config(data=spec["config"])
    t0 = time.time()
    die, ckpt = spec.get("die_after"), spec.get("checkpoint_at")
    state = None
    if spec.get("resume"):
        with open(spec["resume"]) as f:
            state = json.load(f)

    def on_batch(i, ds, rows):
        if ckpt is not None and i + 1 == ckpt:   # a trainer's checkpoint: its stream state
            with open(spec["out"] + ".state.json", "w") as f:
                json.dump(ds.state_dict(), f)
            np.save(spec["out"] + ".ckpt_rows.npy", np.concatenate(rows))
        if die is not None and i + 1 >= die:   # a trainer that crashes: no leave, no cleanup
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
    got = read_rank(cfg, spec["rank"], spec["world"], spec["opts"], on_batch, state)
    arrays = {k: v for k, v in got.items() if isinstance(v, np.ndarray)}
    np.savez(spec["out"] + ".npz", **arrays)
    report = {k: v for k, v in got.items() if not isinstance(v, np.ndarray)}
    report["wall_s"] = time.time() - t0
    with open(spec["out"] + ".json", "w") as f:
        json.dump(report, f, default=repr)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
