"""Column-sharded points under tensor parallelism: z and mlp_act assembled on the output rank.

Under TP each rank's o_proj and down_proj are `RowParallelLinear`s whose input is a column slice
of the full tensor (engine/points.py marks z and mlp_act `sharded`): rank r holds columns
[r * w, (r + 1) * w) of n_heads x head_dim (z) or of the MLP width (mlp_act). Every rank's tap
writes its own slice into its tap buffer, which is allocated at the full width; after each
forward the ranks all-gather the sharded slots (one collective per step for all of them) and
write the rank-ordered concatenation into the same slots (`gather`, compat.tp_gather_columns);
the output rank publishes them. The step ring and the shared destinations then carry full
rows, exactly as for replicated points.

Why a gather and not every rank writing its own columns into the shared destination: vLLM's
multiprocessing executor returns the step from the output rank alone, so the engine's process
would need a per-rank "published" counter and would have to wait on every rank before it reads
a step; the collective is that wait (the output rank publishes only once it holds every slice),
on vLLM's own TP group (its shared-memory all-gather on CPU, NCCL on CUDA). Why an all-gather
and not a gather to the output rank: see compat.tp_gather_columns (the CPU build's gather hung).
Its cost is measured per step (`gather_s` in the rank's summary) and reported.

At load, before anything is compiled, `plan` proves from the module that the tap's slice is the
slice the gather assumes: the site is a `RowParallelLinear` with a parallel input, of this
rank's index, whose per-rank input width is the shard width (compat.row_parallel_input). A
site that is not (a family whose projection is another module) is refused by name.
"""

from __future__ import annotations

import time

from . import compat
from harvest.engine.capture.probe import TrunkRefused
from harvest.engine.capture.sites import module_at
from harvest.engine.points import BY_NAME


def sharded(name: str) -> bool:
    return name in BY_NAME and BY_NAME[name].tp == "sharded"


class ShardGather:
    """The sharded slots of one rank's tap buffer and each one's shard width (one collective
    per step for all of them)."""

    def __init__(self, slots: list[int], shards: list[int]):
        self.slots, self.shards = slots, shards
        self.steps = 0
        self.ns = 0

    def gather(self, buf, n: int) -> None:
        """Every rank, after every forward that ran rows, in the same order."""
        t0 = time.perf_counter_ns()
        compat.tp_gather_columns(buf, self.slots, self.shards, n)
        self.ns += time.perf_counter_ns() - t0
        self.steps += 1

    def summary(self) -> dict:
        return {"gathered_slots": len(self.slots), "gather_steps": self.steps,
                "gather_s": round(self.ns / 1e9, 4)}


def plan(trunk, reads, geometry: dict, tp_rank: int, tp_size: int) -> ShardGather | None:
    """The gather for the sharded reads of `reads` (tap slot order), or None when there are none.
    Raises TrunkRefused naming a sharded point whose site is not a row-parallel projection."""
    slots, shards = [], []
    for slot, a in enumerate(reads):
        if not sharded(a.name):
            continue
        kind = BY_NAME[a.name].width
        shard, full = geometry["kinds"].get(kind), geometry["full_kinds"].get(kind)
        site = trunk.semantics[a.layer].sites[a.name]
        mod = module_at(trunk[a.layer], site.path)
        rp = compat.row_parallel_input(mod)
        want = {"tp_rank": tp_rank, "tp_size": tp_size, "width": shard}
        if rp != want or not shard or shard * tp_size != full:
            raise TrunkRefused(
                f"{a}: tensor_parallel_size={tp_size} splits {a.name} ({kind}, {full} wide) over "
                f"the ranks, and its site {type(trunk[a.layer]).__name__}.{site.path} "
                f"({type(mod).__name__}) is not a row-parallel projection whose input is this "
                f"rank's {shard}-column slice (found {rp}), so the columns each rank holds are "
                "unknown and the row cannot be assembled exactly. Load with "
                "tensor_parallel_size=1 for it")
        slots.append(slot)
        shards.append(int(shard))
    return ShardGather(slots, shards) if slots else None
