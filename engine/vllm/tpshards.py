"""Column-sharded points under tensor parallelism, assembled on the output rank.

Under TP the heads and the MLP's hidden units are split over the ranks (engine/points.py marks
q, k, v, z, mlp_pre, mlp_pre_linear and mlp_act `sharded`): rank r holds columns
[r * w, (r + 1) * w) of n_heads x head_dim (q, z), of n_kv_heads x head_dim (k, v), or of the
MLP width (mlp_pre, mlp_pre_linear, mlp_act). With fewer KV heads than ranks vLLM gives each
rank one KV head, held alike by `replicas` consecutive ranks, so k and v are every
replicas-th rank's slice. Every rank's tap writes its own slice into its tap buffer, which is
allocated at the full width; after each forward the ranks all-gather the sharded slots (one
collective per step for all of them) and write the rank-ordered concatenation into the same
slots (`gather`, compat.tp_gather_columns); the output rank publishes them. The step ring and
the shared destinations then carry full rows, exactly as for replicated points.

Why a gather and not every rank writing its own columns into the shared destination: vLLM's
multiprocessing executor returns the step from the output rank alone, so the engine's process
would need a per-rank "published" counter and would have to wait on every rank before it reads
a step; the collective is that wait (the output rank publishes only once it holds every slice),
on vLLM's own TP group (its shared-memory all-gather on CPU, NCCL on CUDA). Why an all-gather
and not a gather to the output rank: see compat.tp_gather_columns (the CPU build's gather hung).
Its cost is measured per step (`gather_s` in the rank's summary) and reported.

At load, before anything is compiled, `plan` proves from the module that split the columns that
the tap's slice is the slice the gather assumes, of this rank's index and the shard width
(`split`): z and mlp_act are the input of a `RowParallelLinear` with a parallel input
(compat.row_parallel_input); mlp_pre and mlp_pre_linear the output (a half of a fused
gate_up_proj) of a column-parallel projection (compat.column_parallel_output); q, k and v the
inputs of vLLM's attention kernel, split as the block's `QKVParallelLinear` splits them
(compat.qkv_split). A site that is not (a family whose projection is another module) is
refused by name.
"""

from __future__ import annotations

import time

from . import compat
from ..capture.probe import TrunkRefused
from ..capture.sites import module_at
from ..points import BY_NAME


def sharded(name: str) -> bool:
    return name in BY_NAME and BY_NAME[name].tp == "sharded"


class ShardGather:
    """The sharded slots of one rank's tap buffer and each one's shard width (one collective
    per step for all of them)."""

    def __init__(self, slots: list[int], shards: list[int], replicas: list[int] | None = None):
        self.slots, self.shards = slots, shards
        self.replicas = replicas or [1] * len(slots)
        self.steps = 0
        self.ns = 0

    def gather(self, buf, n: int) -> None:
        """Every rank, after every forward that ran rows, in the same order."""
        t0 = time.perf_counter_ns()
        compat.tp_gather_columns(buf, self.slots, self.shards, n, self.replicas)
        self.ns += time.perf_counter_ns() - t0
        self.steps += 1

    def summary(self) -> dict:
        return {"gathered_slots": len(self.slots), "gather_steps": self.steps,
                "gather_s": round(self.ns / 1e9, 4)}


def split(trunk, a, site) -> tuple[str, dict | None]:
    """(what the point's columns are, how vLLM split them on this rank) for sharded point `a`,
    by how its site reads (engine/capture/sites.py): a named input of the attention kernel
    (q, k, v), a projection's output (mlp_pre, mlp_pre_linear), a projection's input (z,
    mlp_act); None when the module is not one that splits them as the gather assumes."""
    layer = trunk[a.layer]
    mod = module_at(layer, site.path)
    if site.arg is not None:
        block = module_at(layer, site.path.rpartition(".")[0]) if "." in site.path else layer
        return (f"the {site.arg} input of {type(layer).__name__}.{site.path} "
                f"({type(mod).__name__}), split by its block's QKVParallelLinear",
                compat.qkv_split(block, site.arg))
    if site.reading == "out":
        which = "" if site.part is None else f" (column block {site.part[0]} of {site.part[1]})"
        return (f"the output{which} of {type(layer).__name__}.{site.path} "
                f"({type(mod).__name__})", compat.column_parallel_output(mod, site.part))
    rp = compat.row_parallel_input(mod)
    return (f"the input of {type(layer).__name__}.{site.path} ({type(mod).__name__})",
            None if rp is None else {**rp, "replicas": 1})


def plan(trunk, reads, geometry: dict, tp_rank: int, tp_size: int) -> ShardGather | None:
    """The gather for the sharded reads of `reads` (tap slot order), or None when there are none.
    Raises TrunkRefused naming a sharded point whose site is not split as the gather assumes."""
    slots, shards, replicas = [], [], []
    for slot, a in enumerate(reads):
        if not sharded(a.name):
            continue
        kind = BY_NAME[a.name].width
        shard, full = geometry["kinds"].get(kind), geometry["full_kinds"].get(kind)
        site = trunk.semantics[a.layer].sites[a.name]
        what, got = split(trunk, a, site)
        rep = got["replicas"] if got else 1
        want = {"tp_rank": tp_rank, "tp_size": tp_size, "width": shard, "replicas": rep}
        if got != want or not shard or shard * tp_size != full * rep:
            raise TrunkRefused(
                f"{a}: tensor_parallel_size={tp_size} splits {a.name} ({kind}, {full} wide) over "
                f"the ranks, and its site, {what}, is not split into this rank's "
                f"{shard}-column slice (found {got}), so the columns each rank holds are "
                "unknown and the row cannot be assembled exactly. Load with "
                "tensor_parallel_size=1 for it")
        slots.append(slot)
        shards.append(int(shard))
        replicas.append(int(rep))
    return ShardGather(slots, shards, replicas) if slots else None
