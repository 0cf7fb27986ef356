"""`harvest verify`: every planned row committed exactly once? Exit 0 only for a complete,
consistent store, 1 otherwise."""

from __future__ import annotations

import sys

from ....store import redact_url

from ..args import print_json, store_args, store_target


def cmd_verify(args) -> int:
    """Exit 0 only for a complete, consistent store: 1 if rows are missing or anything is off."""
    from ....store import open_store

    from ..text import verify_text
    from ..views import store_missing

    url, so = store_target(args)
    if store_missing(url, so):
        print(f"no store at {redact_url(url)} yet: nothing to verify (the job may still be "
              "starting)", file=sys.stderr)
        return 1
    v = open_store(url, storage_options=so, read_only=True).verify(deep=args.deep,
                                                                   objects=args.objects)
    complete = v.complete
    if args.json:
        print_json(args, {**v.as_dict(), "complete": complete})
    else:
        print(verify_text(v, complete))
    return 0 if complete else 1


def add_parser(sub) -> None:
    v = sub.add_parser("verify", help="every planned row committed exactly once?")
    store_args(v)
    v.add_argument("--deep", action="store_true", help="also check every shard's CRC")
    v.add_argument("--objects", action="store_true",
                   help="also list every object and check its size (one LIST page per 1,000 "
                        "objects: slow on object storage at corpus scale)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=cmd_verify)
