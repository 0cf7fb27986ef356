"""`harvest card URL`: write or refresh a finalized store's dataset card (store/card.py).

Finalize writes the card; this rewrites it from the store's attributes, e.g. after `harvest
report` wrote the picture it shows, or for a store finalized before cards existed.
"""

from __future__ import annotations

from ..args import print_json, store_args, store_target


def add_parser(sub) -> None:
    c = sub.add_parser("card", help="write or refresh the store's README.md (dataset card)")
    store_args(c)
    c.add_argument("--print", action="store_true", dest="show", help="print the card too")
    c.add_argument("--json", action="store_true", help="print the card's figures as JSON")
    c.set_defaults(fn=cmd_card)


def cmd_card(args) -> int:
    from ....store import open_store
    from ....store import CARD, card_facts, write_card
    from ....store import StoreError

    url, so = store_target(args)
    store = open_store(url, storage_options=so)
    if store.summary is None:
        raise StoreError(f"harvest card: {url} is not finalized (no summary): finish the run "
                         "(`harvest run` with its config) first; the card describes a whole store")
    text = write_card(store)
    if args.json:
        print_json(args, {"card": f"{store.url.rstrip('/')}/{CARD}", **card_facts(store)})
    else:
        print(text if args.show else f"card: {store.url.rstrip('/')}/{CARD}")
    return 0
