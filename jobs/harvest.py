"""`ray job submit` entrypoint: `python -m harvest.jobs.harvest --config run.yaml [--set k=v ...]`.

Inside a submitted job Ray sets RAY_ADDRESS and the driver connects to that cluster; run by hand
it starts a local one. Same exit codes as `harvest run`: 0 done (or already done), 2 bad input.
"""

from __future__ import annotations

import sys

from ..pipeline.cli.main import main as cli_main


def main(argv: "list[str] | None" = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return cli_main(["run", *argv])


if __name__ == "__main__":
    sys.exit(main())
