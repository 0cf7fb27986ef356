"""`harvest status`: a store's progress, from the store alone (works while a job runs
elsewhere, or on a machine without the engine)."""

from __future__ import annotations

from ..args import show, store_args, store_target


def cmd_status(args) -> int:
    from ..text import status_text
    from ..views import status

    url, so = store_target(args)
    return show(args, status(url, so), status_text)


def add_parser(sub) -> None:
    st = sub.add_parser("status", help="progress of a store, from the store alone")
    store_args(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(fn=cmd_status)
