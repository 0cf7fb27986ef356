"""Keeping secrets out of messages, logs and attributes.

botocore/aiohttp error texts do not normally contain the secret key, but URLs can carry userinfo
(`s3://KEY:SECRET@bucket`), storage_options get pasted into run configs, and a future library
version may echo a signed header. Everything we raise or store passes through here first.
"""

from __future__ import annotations

import os
import re
from typing import Any

# Key names whose string values are secrets. Deliberately narrow: "tokenizer" or "bos_token" are
# run facts that must survive into the attributes.
_SECRET_KEY_NAMES = re.compile(
    r"(secret|password|passwd|credential|access_key|session_token|^(hf_|auth_|api_|access_)?token$"
    r"|^key$|api_key)",
    re.I,
)
_ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
# `user:secret@host` with the scheme already cut off: how botocore and s3fs quote a bucket name
# parsed from such a URL ("Invalid bucket name \"KEY:SECRET@bucket\"")
_BARE_USERINFO = re.compile(r"(?<![\w/:@.+-])[^\s/@:'\"]+:[^\s/@'\"]+@(?=[\w.-])")
REDACTED = "***"


def userinfo(url: str) -> str | None:
    """The `user:secret` part of a URL, or None."""
    m = re.match(r"^[a-z][a-z0-9+.-]*://([^/@\s]+)@", str(url), re.I)
    return m.group(1) if m else None


def redact_url(url: str) -> str:
    """Drop `user:secret@` from a URL so credentials never reach logs, errors or store attrs.
    The one definition (pipeline.config imports it): the store is the lower layer."""
    return re.sub(r"(://)[^/@]*@", r"\1<redacted>@", str(url))


def known_secrets(storage_options: dict | None = None) -> list[str]:
    """Secret strings currently in play: from storage_options and the AWS environment."""
    out: list[str] = []
    for name in _ENV_SECRETS:
        v = os.environ.get(name)
        if v:
            out.append(v)

    def walk(obj: Any, key: str = "") -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, str(k))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, key)
        elif isinstance(obj, str) and obj and _SECRET_KEY_NAMES.search(key):
            out.append(obj)

    walk(storage_options or {})
    # Longest first so a secret that contains another is removed whole.
    return sorted({s for s in out if len(s) >= 4}, key=len, reverse=True)


def scrub(text: str, storage_options: dict | None = None) -> str:
    """Remove userinfo from URLs and every known secret value from `text`."""
    text = _USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", str(text))
    text = _BARE_USERINFO.sub(REDACTED + "@", text)
    for s in known_secrets(storage_options):
        text = text.replace(s, REDACTED)
    return text


def redact_attrs(obj: Any, storage_options: dict | None = None) -> Any:
    """Copy of a JSON-like tree with secret-looking keys and known secret values replaced."""
    secrets = known_secrets(storage_options)

    def walk(o: Any, key: str = "") -> Any:
        if isinstance(o, dict):
            return {k: (REDACTED if _SECRET_KEY_NAMES.search(str(k)) and isinstance(v, str) and v
                        else walk(v, str(k))) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v, key) for v in o]
        if isinstance(o, str):
            for s in secrets:
                o = o.replace(s, REDACTED)
            return _USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", o)
        return o

    return walk(obj)
