"""`harvest-store verify|inspect URL`: check and look at a store with the light install alone.

Scope: the light install's own CLI, two read-only commands and no more. Every command of a full
install, these two included, is the `harvest` CLI (one module per command in
pipeline/cli/commands/); this one exists because the light install has no pipeline to run that
CLI with. New commands go there, not here.

An SAE trainer's environment installs `harvest-store` (no engine, Ray or torch); it must still be
able to answer "is this store complete and intact?" before hours of training on it, with the same
checks as `harvest verify` (store.verify: markers against the plan; `--objects` lists every
object; `--deep` reads every byte against its CRC) and the same `inspect`. Exit codes as in
`harvest`: 0 ok, 1 incomplete or damaged, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from .storage.credentials import redact_url
from .errors import StoreError
from .escape import terminal
from .storage.credentials import StorageOptions


def _options(args) -> StorageOptions | None:
    if not args.storage_options:
        return None
    try:
        return json.loads(args.storage_options)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--storage-options is not JSON ({e}): pass a JSON object, e.g. "
                         '\'{"client_kwargs": {"endpoint_url": "http://host:8333"}}\'') from None


def cmd_verify(args) -> int:
    from . import open_store

    v = open_store(args.url, storage_options=_options(args), read_only=True).verify(
        deep=args.deep, objects=args.objects)
    complete = v.complete
    if args.json:
        print(json.dumps(v.as_dict(), default=str))
        return 0 if complete else 1
    state = "OK" if complete else ("INCOMPLETE" if v.missing_units else "FAILED")
    print(f"{terminal(redact_url(args.url))}: {state}: {v.committed_units:,} of {v.planned_units:,} "
          f"units, {v.committed_rows:,} of {v.planned_rows:,} rows committed"
          f"{' (deep: every byte read)' if v.deep_checked else ''}")
    for e in v.errors[:20]:   # messages quote the store: escaped (store/escape.py)
        print(f"  {terminal(e)}")
    return 0 if complete else 1


def cmd_inspect(args) -> int:
    from .inspect import inspect

    rows = None
    if args.rows:
        try:
            a, b = (int(x) for x in args.rows.split(":"))
        except ValueError:
            print(f"--rows {args.rows!r}: give START:STOP, e.g. 0:16", file=sys.stderr)
            return 2
        rows = (a, b)
    print(json.dumps(inspect(args.url, _options(args), rows=rows), default=str,
                     indent=None if args.json else 1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="harvest-store", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn, text in (("verify", cmd_verify, "every planned row committed exactly once?"),
                           ("inspect", cmd_inspect, "layout, statistics, rows with --rows A:B")):
        p = sub.add_parser(name, help=text)
        p.add_argument("url", help="the store: a directory or s3://bucket/prefix")
        p.add_argument("--storage-options", help="fsspec options as JSON (S3 endpoint, keys)")
        p.add_argument("--json", action="store_true")
        p.set_defaults(fn=fn)
    v = sub.choices["verify"]
    v.add_argument("--deep", action="store_true", help="also read every byte against its CRC")
    v.add_argument("--objects", action="store_true", help="also list every object (slow on S3)")
    sub.choices["inspect"].add_argument("--rows", help="START:STOP rows to show")
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except StoreError as e:
        print(f"harvest-store {args.cmd}: {terminal(e, newlines=True)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
