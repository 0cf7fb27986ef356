"""Capture addresses (`resid_post.10`) and the freeze-point resolution rules.

A frozen engine is built once, before vLLM compiles the model, so the set of points it can serve is
decided here and never changes afterwards. Every rule below is pinned by tests/capture/test_addresses.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from .points import BY_NAME, MODEL_LEVEL, NAMES, point

# The block's own points (its stream in and out, its sublayer outputs); every other point of the
# table (engine/points.py) is read at a module site inside the block (engine/capture/sites.py).
# `resid_streams` exists only on trunks with several residual streams (hyper-connections); none
# of the architectures shipped today has them.
POINTS = ("resid_pre", "resid_post", "attn_out", "mlp_out")
MULTI_STREAM_POINT = "resid_streams"
KNOWN_POINTS = NAMES + (MULTI_STREAM_POINT,)


@dataclass(frozen=True, order=True)
class Address:
    """One capture site: a point name and a layer index, written `name.layer`."""

    name: str
    layer: int

    def __post_init__(self):
        if self.name not in KNOWN_POINTS:
            point(self.name)  # names the refused ones with their reason
            raise ValueError(
                f"unknown point {self.name!r}: known points are {', '.join(KNOWN_POINTS)}"
            )
        if not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"layer of {self.name!r} must be an int >= 0, got {self.layer!r}")
        if self.name in MODEL_LEVEL and self.layer != 0:
            raise ValueError(f"{self.name!r} is a model-level point (one per model): address it "
                             f"as '{self.name}.0', not '{self.name}.{self.layer}'")

    @property
    def spec(self):
        """This point's row of the table (engine/points.py)."""
        return BY_NAME[self.name]

    def __str__(self) -> str:
        return f"{self.name}.{self.layer}"

    @classmethod
    def parse(cls, value: "str | Address") -> "Address":
        if isinstance(value, Address):
            return value
        name, sep, layer = str(value).rpartition(".")
        if not sep or not layer.isdigit():
            raise ValueError(
                f"bad address {value!r}: write it as '<point>.<layer>', e.g. 'resid_post.10'"
            )
        return cls(name, int(layer))


def parse_addresses(values: Iterable["str | Address"], n_layers: int) -> tuple[Address, ...]:
    """Parse and range-check a list of addresses, keeping order and dropping duplicates."""
    out: list[Address] = []
    for v in values:
        a = Address.parse(v)
        if a.layer >= n_layers:
            raise ValueError(f"address {a} is out of range: the model has layers 0..{n_layers - 1}")
        if a not in out:
            out.append(a)
    return tuple(out)


def all_layers(name: str, n_layers: int) -> tuple[Address, ...]:
    return tuple(Address(name, i) for i in range(n_layers))


@dataclass(frozen=True)
class FreezeSet:
    """What a frozen engine installs: read taps and write (steering) buffers.

    `reads == writes == ()` is graph mode with no taps at all (plain compiled vLLM).
    """

    reads: tuple[Address, ...]
    writes: tuple[Address, ...]

    def check_read(self, points: Sequence[Address]) -> None:
        """Refuse points outside the frozen set: an empty answer would look like real data."""
        missing = [str(p) for p in points if p not in self.reads]
        if missing:
            froze = ", ".join(map(str, self.reads)) or "nothing"
            raise ValueError(
                f"this engine was frozen with reads [{froze}] and cannot serve {', '.join(missing)}; "
                "load it with freeze_points including them (or enforce_eager=True for hooks)"
            )


class FreezePlan(NamedTuple):
    """What `resolve_freeze_points` decided: `reads, writes, graph = plan`.

    graph=False is the hooked mode (eager engine, Python hooks, no frozen set); graph=True is a
    compiled engine with exactly `reads`/`writes` frozen in (both empty: plain vLLM, no taps).
    """

    reads: tuple[Address, ...]
    writes: tuple[Address, ...]
    graph: bool

    def freeze_set(self) -> FreezeSet | None:
        """The frozen set a graph-mode engine installs; None in hooked mode."""
        return FreezeSet(self.reads, self.writes) if self.graph else None


HOOKED = FreezePlan((), (), False)


def resolve_freeze_points(
    freeze_points=None,
    n_layers: int = 0,
    n_streams: int = 1,
    freeze_writes=None,
    enforce_eager: bool | None = None,
) -> FreezePlan:
    """Decide the frozen read/write set and whether the engine runs a graph at all.

    - freeze_points omitted with enforce_eager not False (None or True): hooked mode, no graph.
      `freeze_writes=[]` alone changes nothing here: it is not graph mode.
    - "auto", or enforce_eager=False with no list: resid_post at every layer (resid_streams when
      the trunk has several residual streams), and writes == reads unless freeze_writes=[] asks
      for reads without write buffers. None and [] differ only here.
    - an explicit read list implies no writes; a named write list without reads is writes-only.
    - freeze_points=[] is graph mode with no taps.
    - enforce_eager=True with any freeze set is refused: hooks and freeze are exclusive.
    """
    if isinstance(freeze_points, str) and freeze_points != "auto":
        raise ValueError(
            f"freeze_points={freeze_points!r} is not understood: pass 'auto', a list of "
            "addresses such as ['resid_post.3'], [] for graph mode with no taps, or omit it"
        )
    asked_freeze = freeze_points is not None or bool(freeze_writes)
    if enforce_eager:
        if asked_freeze:
            raise ValueError(
                "enforce_eager=True runs Python hooks, which cannot be combined with a freeze set: "
                "omit freeze_points (and freeze_writes) for the hooked mode, or drop enforce_eager "
                "for freeze mode"
            )
        return HOOKED
    if freeze_points is None and not freeze_writes and enforce_eager is None:
        return HOOKED
    auto_name = MULTI_STREAM_POINT if n_streams > 1 else "resid_post"
    if freeze_points == "auto" or (freeze_points is None and not freeze_writes):
        reads = all_layers(auto_name, n_layers)
        writes = reads if freeze_writes is None else parse_addresses(freeze_writes, n_layers)
        return FreezePlan(reads, writes, True)
    reads = parse_addresses(freeze_points or [], n_layers)
    writes = parse_addresses(freeze_writes or [], n_layers)
    return FreezePlan(reads, writes, True)
