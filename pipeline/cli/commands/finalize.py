"""`harvest finalize URL`: the operator's repair that publishes and finalizes a store.

It publishes what is committed (completes pending uploads, checks every object of each unit
without a publish record, records it; store/commit/published.py), uncommits units whose data is
gone or damaged so that the next run re-captures them, and finalizes the store only when its plan
is fully committed: a store whose plan is not is never shrunk (the resume could not write the
rest). It refuses while a driver holds the store's lease (a running job writes there), like
`harvest uncommit` (uncommit.py). Exit codes: 0 finalized, 1 not finalized (the plan is not fully
committed, or units were uncommitted), 2 bad input.
"""

from __future__ import annotations

from ..args import open_for_repair, print_json, store_args


def cmd_finalize(args) -> int:
    from ....store import plan_gap
    from ....store import settle_text

    store, shown = open_for_repair(args, "finalize")
    report = store.ledger.settle(repair=True)
    out = {"store": shown, "published_now": report.published, "gone": report.gone,
           "damaged": report.damaged, "uncommitted": report.uncommitted,
           "finalized": False}
    lines = []
    if report.published:
        lines.append(f"published {len(report.published)} committed units their writers had "
                     f"not: {report.published[:20]}")
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
        already = store.summary is not None and not report.published
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


def add_parser(sub) -> None:
    f = sub.add_parser("finalize", help="publish what is committed, uncommit units whose data is "
                       "gone, finalize when the plan is fully committed")
    store_args(f)
    f.add_argument("--json", action="store_true")
    f.set_defaults(fn=cmd_finalize)
