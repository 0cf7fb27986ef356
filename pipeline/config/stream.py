"""The `stream:` section: how a run hands its rows to trainers with no store in between
(harvest.stream, pipeline/stream/; docs/store.md, "Streaming to trainers").

What the trainers read (points, batch size, filters, normalisation, shuffle window) is each
trainer's ReaderConfig, given to `harvest.stream(config, ...)` like the store reader's options;
this section holds what the run itself needs: whether it also writes the store (a tee), the dtype
on the wire, and the memory the capture side may hold for each trainer rank before capture
pauses. A leaf: config helpers only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fields import ConfigError, check_bool, check_choice, check_float, check_int, check_str
from .sections import MAX_SECONDS, STORE_DTYPES


@dataclass(frozen=True)
class StreamConfig:
    """`stream:` options of a streamed run (ignored by `harvest run`, which writes a store).

    tee: also write the store at `store.url`, as `harvest run` would (same units, markers,
        verify); the trainers get the same rows either way.
    dtype: the rows on the wire: the store's dtype (None: store.dtype, else the model's), or
        `float8_e4m3fn` (quantised in the capture actor, one float32 scale per row, as an fp8
        store holds them: half the bytes of bf16). With a tee it must be the store's dtype.
    send_buffer_rows: rows a capture actor holds for one trainer rank before its capture pauses
        (the capture side's memory bound: actors x ranks x rows x row bytes).
    take_rows: rows a trainer takes from one actor per request.
    name: the stream's name: trainers that give the same config join the same stream (None:
        the config's `name`).
    join_timeout_s: how long the capture waits for every trainer rank to join before it stops.
    rank_timeout_s: a rank that joined and has not been heard from for this long (its process
        died: a trainer's receiver thread reports every second, paused or not) stops the
        stream, saying so. A rank that comes back sooner with its saved state
        (`load_state_dict`) resumes: the units it had not finished are captured again for it.
    replay_units: how many of the latest units the stream can capture again for a resuming
        rank (their token references are kept: 16 bytes a token in Ray's object store); a rank
        whose saved position is older is refused, saying so.
    linger_s: after the last row is taken, how long the stream waits for its ranks to say they
        are done (or for a rank to rejoin from a saved state) before it goes away.
    """

    tee: bool = False
    dtype: str | None = None
    send_buffer_rows: int = 8192
    take_rows: int = 4096
    name: str | None = None
    join_timeout_s: float = 900.0
    rank_timeout_s: float = 60.0
    replay_units: int = 64
    linger_s: float = 120.0

    def validate(self) -> None:
        check_bool("stream.tee", self.tee)
        if self.dtype is not None:
            check_choice("stream.dtype", self.dtype, STORE_DTYPES)
        check_int("stream.send_buffer_rows", self.send_buffer_rows, 1)
        check_int("stream.take_rows", self.take_rows, 1)
        if self.name is not None:
            check_str("stream.name", self.name)
            if "/" in self.name or not self.name.strip():
                raise ConfigError(f"stream.name={self.name!r}: use a plain name (no '/'), e.g. "
                                  "'smollm2-l15'")
        check_float("stream.join_timeout_s", self.join_timeout_s, 0.1, MAX_SECONDS)
        check_float("stream.rank_timeout_s", self.rank_timeout_s, 1.0, MAX_SECONDS)
        check_int("stream.replay_units", self.replay_units, 1)
        check_float("stream.linger_s", self.linger_s, 0.0, MAX_SECONDS)


__all__ = ["StreamConfig"]
