"""`harvest run|plan|status|verify|finalize|uncommit|inspect|report|...`: the pipeline for people.

`status`, `verify` and `inspect` read the store alone (a URL or the store of a config), so they
work while a job runs elsewhere, after it was interrupted, or on a machine without the engine.
Errors we can explain end the command with exit code 2 and one line, not a traceback. Ctrl-C
exits 130, SIGTERM 143 and SIGHUP 129 (128 + the signal), after the same cleanup (pipeline/driver/exits.py).
"""

from __future__ import annotations

import argparse
import sys

from .args import is_user_error
from .commands import (card, check_model, finalize, inspect, plan, report, run, schedule,
                       shuffle, status, uncommit, verify)
from ...store import terminal

EXIT_BAD_INPUT = 2

# in the order `harvest --help` lists them
COMMANDS = (run, plan, status, verify, inspect, report, check_model, schedule, card, shuffle,
            finalize, uncommit)


def _setup_logging(verbose: bool) -> None:
    from ..logs import setup_console

    setup_console(verbose)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="harvest", description=__doc__.splitlines()[0])
    p.add_argument("--verbose", "-v", action="store_true",
                   help="show vLLM's, Ray's and torch's output too (run: instead of a log file)")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for sp in sub.choices.values():  # `harvest run --verbose` as well as `harvest --verbose run`
        sp.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS)
    return p


def main(argv: "list[str] | None" = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from ..driver.exits import orderly_signals
    from ..logs import json_stdout

    try:
        with orderly_signals():
            if not getattr(args, "json", False):
                return args.fn(args)
            with json_stdout() as args.json_out:
                return args.fn(args)
    except BrokenPipeError:  # `harvest inspect | head`
        return 0
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP (exits.Terminated)
        how = f"stopped by {e}" if getattr(e, "exit_code", None) else "interrupted"
        print(f"harvest {args.cmd}: {how}: the store is resumable, re-run the same command",
              file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except Exception as e:
        # masked: a presigned data.source or a token can sit in any message (credentials.py)
        from ...store import scrub

        if is_user_error(e):
            # the message may quote a store's text (store/escape.py) or a secret: neither reaches
            # the terminal
            print(scrub(f"harvest {args.cmd}: error: {terminal(e, newlines=True)}"), file=sys.stderr)
            return EXIT_BAD_INPUT
        import traceback

        print(scrub(traceback.format_exc()), file=sys.stderr, end="")
        return 1


if __name__ == "__main__":
    sys.exit(main())
