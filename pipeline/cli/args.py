"""What every `harvest` command shares: the config arguments, the config they load, the store a
command reads, and the one JSON document `--json` prints.

Its own module so that main.py and every command module (commands/) import it at the top: in
main.py, a command could reach them only through a function-level import, an import cycle hidden
from the reader.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from ..config.run import ConfigError, HarvestConfig, default_config_path, load_config


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help=f"run config YAML (default {default_config_path()})")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set packing.context_size=256 (repeatable)")


def store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", help="store URL or path (default: store.url of the config)")
    config_args(p)


def load_args_config(args) -> HarvestConfig:
    """The run config `--config` names (or the default), with the `--set` overrides applied."""
    return load_config(args.config or default_config_path(), args.set)


def store_target(args) -> tuple[str, dict | None]:
    """(URL, fsspec options) of the store a command reads: the URL given, else the config's."""
    if args.url:
        return args.url, None
    cfg = load_args_config(args)
    return cfg.store.resolved_url, cfg.store.fs_options()


def open_for_repair(args, what: str):
    """(store, URL shown) of the store `finalize` or `uncommit` repairs: it must exist, and no
    driver may hold its lease (a running job writes there)."""
    from ...store import open_store
    from ...store import redact_url

    from ..config.run import StoreConfig
    from ..errors import HarvestError
    from ..driver.lease import refuse_if_held
    from .views import store_missing

    url, so = store_target(args)
    shown = redact_url(url)
    if store_missing(url, so):
        raise HarvestError(f"no store at {shown}: nothing to {what}")
    store = open_store(url, storage_options=so)
    refuse_if_held(store.location, StoreConfig.lease_seconds, shown)
    return store, shown


def print_json(args, obj) -> None:
    """The command's one JSON document, on the stream `main` keeps for it (logs.json_stdout:
    nothing else reaches stdout under --json)."""
    print(json.dumps(obj, indent=2, default=str), file=getattr(args, "json_out", None) or sys.stdout)


def show(args, obj, text: "Callable[[Any], str]") -> int:
    """A command's result: `obj` as its JSON document under --json, else `text(obj)`; exit 0."""
    if args.json:
        print_json(args, obj)
    else:
        print(text(obj))
    return 0


def is_user_error(e: BaseException) -> bool:
    """An error in what the user gave (config, data, store): exit 2 with its message, no
    traceback (`harvest` main; `harvest schedule` also posts it to its webhook)."""
    from ..data.documents import DataError
    from ..errors import HarvestError
    from ..data.packing import PackingError

    try:
        from ...store import StoreError
    except Exception:  # pragma: no cover
        StoreError = ()  # type: ignore
    return isinstance(e, (ConfigError, DataError, PackingError, HarvestError, StoreError))
