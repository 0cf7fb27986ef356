"""`harvest run` in a process of its own, held at a gate: for tests that stop, pause or kill a
run mid-way.

`python -m tests.support.gated_driver CONFIG READY HOLD [OPEN]` runs the real CLI (`harvest run
--config CONFIG`: its signal handling, exit codes and lease) with an on_event hook that, once HOLD
units are done with unit 0 among them, writes the ids of the units done to READY and blocks the
driver's loop: for good without OPEN (the test kills the process there), else until the file
OPEN exists (the test opens the gate; the run then goes on to its end).

The loop dispatches units and receives their results, so while it is held no unit is dispatched:
the units committed meanwhile are at most the HOLD done and those already in flight
(`ray.max_in_flight` per actor). The run cannot finish before the test has done what it does at
the gate, however fast the machine: stopping it mid-way never depends on winning a race against
the clock.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def hold_after(ready: Path, hold: str, gate: "Path | None"):
    """The on_event hook; see the module docstring. `hold` "N": after N units done, unit 0 among
    them; "sent:N": after the N-th unit is handed to an actor, so no more than N units are ever
    dispatched (the test then waits for their commits in the store)."""
    done: set[int] = set()
    state = {"held": False}
    sent = hold.startswith("sent:")
    n = int(hold.split(":")[-1])

    def hook(e: dict) -> None:
        if e.get("event") != ("unit_sent" if sent else "unit_done") or state["held"]:
            return
        done.add(int(e["unit"] if sent else e["unit_id"]))
        if len(done) >= n and (sent or 0 in done):
            state["held"] = True
            tmp = ready.with_name(ready.name + ".tmp")
            tmp.write_text(json.dumps(sorted(done)))
            tmp.replace(ready)
            while gate is None or not gate.exists():
                time.sleep(0.05)   # interruptible: SIGTERM's handler runs here

    return hook


def main(argv: list[str]) -> int:
    config, ready, hold, *opened = argv
    from harvest.pipeline.driver import run as driver
    from harvest.pipeline.cli.main import main as cli_main

    hook = hold_after(Path(ready), hold, Path(opened[0]) if opened else None)
    real_run = driver.run

    def gated_run(cfg, on_event=None, **kw):
        if on_event is not None:
            raise AssertionError("gated_driver: the CLI passed its own on_event")
        return real_run(cfg, on_event=hook, **kw)

    driver.run = gated_run   # cmd_run imports driver.run when it runs
    return cli_main(["run", "--config", config])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
