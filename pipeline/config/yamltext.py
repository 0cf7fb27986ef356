"""Reading a config: YAML text without duplicate keys, `a.b=value` overrides, merge, field hints.

Plain helpers that know nothing of the sections, so pipeline/config/run.py (which does) stays the one
place where a YAML mapping becomes a HarvestConfig.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from .fields import ConfigError


def load_yaml_unique(text: str, where: str) -> Any:
    """yaml.safe_load that refuses a key written twice in one mapping.

    PyYAML keeps the last of two equal keys without a word: a config with two `packing:`
    sections ran with the second one only, and the first one's settings were silently lost.
    """
    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"{where}: {key!r} is written twice (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); YAML would keep only the last one: merge "
                    "them into one")
            seen[key] = key_node.start_mark.line
        return loader.construct_mapping(node, deep=deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                    construct_mapping)
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}): save it "
                          "as UTF-8") from None


def parse_override(item: str) -> dict:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"override {item!r} is not 'section.field=value', e.g. packing.context_size=256"
        )
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    out: dict = {}
    cur = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = parsed
    return out


def unknown_msg(key: str, known: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {prefix}{close[0]}? " if close else ""
    return f"unknown field {prefix}{key}: {hint}known fields are {', '.join(known)}"


def deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
