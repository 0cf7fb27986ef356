"""`harvest finalize URL` and `harvest uncommit URL --unit N`: the operator's store repairs.

`finalize` publishes what is committed (completes pending uploads, checks every object of each
unit without a publish record, records it; store/commit/published.py), uncommits units whose data is
gone or damaged so that the next run re-captures them, and finalizes the store only when its plan
is fully committed: a store whose plan is not is never shrunk (the resume could not write the
rest). `uncommit` drops units' commit markers so that the same harvest, run again, re-captures
them (the repair for a unit whose objects were deleted or damaged after it was published).

Both refuse while a driver holds the store's lease (a running job writes there). Exit codes:
0 done (finalized; uncommitted), 1 not finalized (the plan is not fully committed, or units were
uncommitted), 2 bad input.
"""

from __future__ import annotations

import sys

from .args import print_json, store_args, store_target
from harvest.store.storage.credentials import redact_url


def _open_for_repair(args, what: str):
    from harvest.store import open_store

    from harvest.pipeline.config.run import StoreConfig
    from harvest.pipeline.errors import HarvestError
    from harvest.pipeline.driver.lease import refuse_if_held
    from .views import store_missing

    url, so = store_target(args)
    shown = redact_url(url)
    if store_missing(url, so):
        raise HarvestError(f"no store at {shown}: nothing to {what}")
    store = open_store(url, storage_options=so)
    refuse_if_held(store.location, StoreConfig.lease_seconds, shown)
    return store, shown


def cmd_finalize(args) -> int:
    from harvest.store.commit.finalize import plan_gap
    from harvest.store.commit.published import settle_text

    store, shown = _open_for_repair(args, "finalize")
    report = store.settle(repair=True)
    out = {"store": shown, "published_now": report["published"], "gone": report["gone"],
           "damaged": report["damaged"], "uncommitted": report["uncommitted"],
           "finalized": False}
    lines = []
    if report["published"]:
        lines.append(f"published {len(report['published'])} committed units their writers had "
                     f"not: {report['published'][:20]}")
    text = settle_text(report, shown)
    gap = plan_gap(store)
    if text is not None:
        lines.append(text)
        out["reason"] = "units were uncommitted"
    elif gap is not None:
        out["reason"] = gap
        lines.append(f"not finalized: {gap}; every committed unit is published. Re-run the same "
                     "harvest to finish it (it finalizes at the end)")
    else:
        already = store.summary is not None and not report["published"]
        if not already:
            store.finalize(store.summary or {"finalized_by": "harvest finalize"})
        out["finalized"] = True
        lines.append(f"{shown}: finalized" + (" already; every committed unit is published"
                                             if already else ""))
    if getattr(args, "json", False):
        print_json(args, out)
    else:
        print("\n".join(lines))
    return 0 if out["finalized"] else 1


def cmd_uncommit(args) -> int:
    units = sorted({int(u) for part in args.unit for u in str(part).split(",") if u.strip()})
    store, shown = _open_for_repair(args, "uncommit")
    committed = {n.unit_id for n in store.marker_names()}
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


def add_parsers(sub) -> None:
    f = sub.add_parser("finalize", help="publish what is committed, uncommit units whose data is "
                       "gone, finalize when the plan is fully committed")
    store_args(f)
    f.add_argument("--json", action="store_true")
    f.set_defaults(fn=cmd_finalize)
    u = sub.add_parser("uncommit", help="drop units' commit markers: the next run re-captures them")
    store_args(u)
    u.add_argument("--unit", action="append", required=True, metavar="N[,N...]",
                   help="unit id(s) to uncommit (repeatable)")
    u.set_defaults(fn=cmd_uncommit)
