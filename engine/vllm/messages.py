"""What a capture worker answers the engine's RPCs, as typed records.

Under tensor parallel each worker is its own process and vLLM's executor pickles an RPC's
result back to the engine's process (compat.worker_calls). A misspelt key in a dict would fail
only where it is read, in the other process; a frozen dataclass fails where it is built, naming
the field (pipeline/messages.py makes the same choice for Ray's messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's capture state (`harvest_info`; None from a worker built without a harvest
    config)."""

    mode: str
    """"freeze", "plain", ...: the capture mode the worker's taps were built for."""
    runner: str
    """"v1" or "v2": which of vLLM's model runners the worker's runner extends."""
    report: dict[str, Any]
    """The taps' placement report (layer -> what was tapped), as the worker built it."""
    publishes: bool
    """This rank publishes the step's rows to the step ring (exactly one rank does)."""
    publishes_stats: bool
    """This rank's step counts are the engine's (the output rank: vLLM returns its output)."""
    summary: dict[str, Any]
    """The worker's capture summary (HarvestState.summary): steps, tokens, timings."""
