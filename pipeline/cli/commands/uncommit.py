"""`harvest uncommit URL --unit N`: drop units' commit markers, so that the same harvest, run
again, re-captures them (the repair for a unit whose objects were deleted or damaged after it was
published). It refuses while a driver holds the store's lease (a running job writes there).
Exit codes: 0 uncommitted, 2 bad input (a unit that is not committed included).
"""

from __future__ import annotations

import sys

from ..args import open_for_repair, store_args


def cmd_uncommit(args) -> int:
    units = sorted({int(u) for part in args.unit for u in str(part).split(",") if u.strip()})
    store, shown = open_for_repair(args, "uncommit")
    committed = {n.unit_id for n in store.ledger.marker_names()}
    absent = [u for u in units if u not in committed]
    if absent:
        print(f"harvest uncommit: units {absent} of {shown} are not committed: nothing done "
              f"(committed units: {len(committed)})", file=sys.stderr)
        return 2
    for u in units:
        store.uncommit(u)
    print(f"uncommitted units {units} of {shown}: run the same harvest again to re-capture "
          "them (readers skip them until then)")
    return 0


def add_parser(sub) -> None:
    u = sub.add_parser("uncommit", help="drop units' commit markers: the next run re-captures them")
    store_args(u)
    u.add_argument("--unit", action="append", required=True, metavar="N[,N...]",
                   help="unit id(s) to uncommit (repeatable)")
    u.set_defaults(fn=cmd_uncommit)
