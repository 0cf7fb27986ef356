"""What streaming a run costs beside writing and reading a store, for `harvest plan`.

Per GPU (per actor on a CPU run) at the planned rate: the rows' bytes a second, the host cores
the capture side spends handing them to trainers (the actor's deal and queues, Ray's object
store) against the cores it spends writing a store; the cores the trainers spend receiving them
against the store reader's (decode and gather, every epoch); and the bytes: a stream moves each
row once over the network to its trainer and stores nothing, a store keeps `bytes_stored` and
reads them back each epoch. All four figures come from one harness, so they compare: the
capture side's include what both paths share there (the engine's row copy, the tokenisers),
which is why its store figure is above bench_dataplane's write path alone (`plan`'s dataplane
line).

The core-seconds per GB are measured by benchmarks/bench_stream.py (RESULTS.md, "Streaming to
trainers": both paths in one run, the engine a stub so only the data plane counts, after the
engines' start-up), per GB of bf16 rows on this project's shared 2-core VM; an fp8 stream moves
half the bytes (its wire bytes price it).
"""

from __future__ import annotations

# bench_stream, 2026-12-06 (results/stream.json), SmolLM2's shape (30 x 576) and the 8B row
# (32 x 4096): the larger of the two shapes' figures, after start-up, rounded up
STREAM_CAPTURE_CORE_S_PER_GB = 1.9    # capture actors: deal, queue, serialise into Ray's store
STREAM_TRAINER_CORE_S_PER_GB = 2.6    # trainer: receive, window copy, batch gather
STORE_WRITE_CORE_S_PER_GB = 6.0       # capture actors writing a store (same harness)
STORE_READ_CORE_S_PER_GB = 2.9        # the store reader: fetch, decode, gather, one epoch
SOURCE = ("measured by bench_stream (both paths in one run, stub engine, after start-up) on 2 "
          "shared cores: an upper bound")


def stream_cost(rate: float, units: int, tokens: "int | None", bytes_per_token: int,
                wire_bytes_per_token: int, bytes_stored: "int | None", per: str) -> dict:
    """The stream's figures beside the store's, at `rate` tok/s over `units` GPUs (or actors):
    `bytes_per_token` of bf16 rows (what the core-s figures are per), `wire_bytes_per_token`
    in the stream's dtype."""
    write_core_s = STORE_WRITE_CORE_S_PER_GB
    gb_s = rate * bytes_per_token / 1e9 / units
    wire = wire_bytes_per_token / bytes_per_token
    out = {
        "per": per, "gb_per_second_per": round(gb_s, 3),
        "network_gb_per_second_per": round(gb_s * wire, 3),
        "network_bytes": int(tokens * wire_bytes_per_token) if tokens else None,
        "capture_cores_per": round(gb_s * wire * STREAM_CAPTURE_CORE_S_PER_GB, 2),
        "trainer_cores_total": round(gb_s * units * wire * STREAM_TRAINER_CORE_S_PER_GB, 2),
        "store_write_cores_per": round(gb_s * write_core_s, 2),
        "store_read_cores_total_per_epoch": round(gb_s * units * STORE_READ_CORE_S_PER_GB, 2),
        "bytes_stored": bytes_stored,
        "core_s_per_gb": {"stream_capture": STREAM_CAPTURE_CORE_S_PER_GB,
                          "stream_trainer": STREAM_TRAINER_CORE_S_PER_GB,
                          "store_write": write_core_s, "store_read": STORE_READ_CORE_S_PER_GB},
        "source": SOURCE,
    }
    return out


__all__ = ["stream_cost"]
