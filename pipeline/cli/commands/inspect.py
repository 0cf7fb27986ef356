"""`harvest inspect`: a store's layout, statistics, run attributes, and rows on request."""

from __future__ import annotations

from ..args import show, store_args, store_target


def cmd_inspect(args) -> int:
    from ..text import inspect_text
    from ....store import inspect

    url, so = store_target(args)
    rows = None
    if args.rows:
        a, _, b = args.rows.partition(":")
        rows = (int(a), int(b) if b else int(a) + 8)
    return show(args, inspect(url, so, rows), inspect_text)


def add_parser(sub) -> None:
    i = sub.add_parser("inspect", help="layout, statistics, run attributes, rows with --rows A:B")
    store_args(i)
    i.add_argument("--rows", help="rows to show, e.g. 0:16")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_inspect)
