"""Field checks shared by the config sections: each error names the field as written in YAML."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """Bad configuration; the message names the field and the fix."""


def check_str(name: str, v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{name} must be a non-empty string, got {v!r}")


def check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be true or false, got {v!r}")


def check_choice(name: str, v: Any, choices: tuple) -> None:
    if v not in choices:
        raise ConfigError(f"{name}={v!r} is not one of {', '.join(map(str, choices))}")


def check_int(name: str, v: Any, lo: int, optional: bool = False) -> None:
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
    if v < lo:
        raise ConfigError(f"{name} must be >= {lo}, got {v}")


def check_float(name: str, v: Any, lo: float, hi: float | None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name} must be a number, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name} must be {rng}, got {v}")
