"""Train a TopK SAE with DDP on rows streamed straight from the capture (no store in between).

    python examples/train_stream.py --config jobs/configs/tiny.yaml --world-size 2
    python examples/train_stream.py --config run.yaml --point resid_post.15 --ray-train \\
        --world-size 4                          # the ranks as Ray Train workers

Each rank calls `harvest.stream(config, point, batch_size, rank=r, world_size=W)`: the first
rank to arrive starts the capture (a coordinator actor on the Ray cluster runs it), the others
join; each rank gets disjoint rows, the same number on every rank, normalised with constants
from every rank's first window. By default the ranks are processes of this script, each joining
the stream through the cluster's address (as trainers on other machines would; gloo DDP); with
`--ray-train` they are Ray Train's TorchTrainer workers. The SAE is examples/train_topk.py's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))


def train(config: str, point: str, rank: int, world: int, batch: int, k: int, expansion: int,
          name: str) -> dict:
    """One rank: its stream, DDP over gloo, a TopK SAE; returns its figures."""
    import torch
    import torch.distributed as dist

    import harvest
    from harvest.pipeline.config.run import load_config
    from harvest.store import on_device
    from train_topk import TopKSAE

    cfg = load_config(config, overrides=[f"stream.name={name}"])
    ds = harvest.stream(cfg, point, batch_size=batch, rank=rank, world_size=world,
                        exclude_special=True, seqpos=slice(2, None), normalize="norm_scale",
                        drop_last=True)
    sae = None
    losses, t0 = [], time.perf_counter()
    for x in on_device(ds):   # the adapters take a stream as they take a store's dataset
        if sae is None:
            torch.manual_seed(0)   # every rank starts from the same SAE
            sae = TopKSAE(x.shape[1], expansion * x.shape[1], k)
            model = torch.nn.parallel.DistributedDataParallel(sae) if world > 1 else sae
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        loss = ((model(x) - x) ** 2).sum(-1).mean() / x.shape[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sae.normalize_decoder()
        losses.append(loss.item())
    if world > 1:
        dist.barrier()
    f = ds.figures()
    return {"rank": rank, "steps": len(losses), "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "rows": f["rows_yielded"], "rows_per_second": f["rows_per_second"],
            "seconds": round(time.perf_counter() - t0, 1), "norm": ds.norm_constants.source,
            "mixing": ds.describe().get("vs_uniform")}


def _process_rank(a) -> None:
    import ray
    import torch.distributed as dist

    ray.init(address=a.address, log_to_driver=False)
    if a.world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}",
                                rank=a.rank, world_size=a.world_size)
    print(train(a.config, a.point, a.rank, a.world_size, a.batch_size, a.k, a.expansion, a.name),
          flush=True)


def _ray_train(a) -> None:
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(c):
        from ray import train as rt

        ctx = rt.get_context()
        rt.report(train(c["config"], c["point"], ctx.get_world_rank(), ctx.get_world_size(),
                        c["batch"], c["k"], c["expansion"], c["name"]))

    if not ray.is_initialized():
        ray.init(address=a.address)
    trainer = TorchTrainer(loop, train_loop_config={
        "config": a.config, "point": a.point, "batch": a.batch_size, "k": a.k,
        "expansion": a.expansion, "name": a.name},
        scaling_config=ScalingConfig(num_workers=a.world_size,
                                     resources_per_worker={"CPU": a.cpus_per_rank}))
    print(trainer.fit().metrics)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "jobs" / "configs" / "tiny.yaml"))
    ap.add_argument("--point", default="resid_post.1")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--expansion", type=int, default=4)
    ap.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                    help="the Ray cluster (default: RAY_ADDRESS, else a local one)")
    ap.add_argument("--name", default=f"example-{os.getpid()}", help="the stream's name")
    ap.add_argument("--ray-train", action="store_true", help="ranks as Ray Train workers")
    ap.add_argument("--cpus-per-rank", type=float, default=0.25)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29511, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        _process_rank(a)
        return 0
    if a.address is None:   # a local cluster that the rank processes join by its address
        import ray

        a.address = ray.init().address_info["gcs_address"]
    if a.ray_train:
        _ray_train(a)
        return 0
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--address", a.address,
                               "--name", a.name, "--rank", str(r)]) for r in range(a.world_size)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    raise SystemExit(main())
