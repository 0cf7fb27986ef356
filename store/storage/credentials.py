"""Keeping secrets out of messages, logs, attributes and records: the one place that says what a
secret looks like and how it is masked.

Secrets reach harvest in three shapes, and each has one rule here:

- URL userinfo, `s3://KEY:SECRET@bucket`: masked to `s3://***@bucket`.
- URL query credentials: a presigned S3 URL (`X-Amz-Credential`, `X-Amz-Signature`,
  `X-Amz-Security-Token`), a signed GCS URL (`X-Goog-Credential`, `X-Goog-Signature`,
  `GoogleAccessId`/`Signature`), an Azure SAS (`sig`), and generic `token`, `access_token`,
  `key`, `api_key`, `signature`, `password`... (`secret_param`). Their values are masked
  (`?X-Amz-Signature=***`); everything else of the URL stays (scheme, host, path, and the
  parameters that are not secret: `X-Amz-Date`, `X-Amz-Expires`, a SAS's `se`/`sp`/`sv`, which
  say when and for what the URL was signed, useful when one expires mid-run).
- Storage options and headers: values under secret-looking keys (`secret`, `token`, `key`,
  `Authorization`, `x-amz-security-token`, `Cookie`, ..., in nested `headers`/`client_kwargs`
  dicts too) and the AWS credentials in the environment.

`mask_text` applies the first two to any text (a URL, an error message, a log line); `scrub` adds
the known secret values of the storage options and the environment; `redact_attrs` and
`redact_options` walk JSON-like trees. `url_identity` is not a mask but the secret-free identity
of a source URL, for comparisons across runs (see its docstring). Every recording path (store
attributes, provenance, run summary, lease, schedule records, the dataset card, logs, errors,
reprs) goes through one of these.
"""

from __future__ import annotations

import os
import re
from typing import Any

StorageOptions = dict[str, Any]
"""A store's storage options as the config or caller gives them (JSON: credentials, endpoint,
timeouts, a backend's own keywords), handed on to the backend (fsspec for object storage)."""

REDACTED = "***"

# Key names whose string values are secrets (storage options, headers, attributes). Narrow
# enough that run facts survive: "tokenizer", "tokens_column", "bos_token", "eos_token".
_SECRET_KEY_NAMES = re.compile(
    r"(secret|password|passwd|credential|access[-_]?key|account[-_]?key|api[-_]?key|signature|"
    r"authorization|cookie|connection_string|"
    r"^(?!(bos|eos|pad|unk|sep|cls|mask)_token$)([\w-]*[-_])?token$|^key$|^sig$)",
    re.I,
)
# `Authorization: Bearer <secret>`: the secret alone is also known (a library may echo it bare)
_AUTH_SCHEME = re.compile(r"^(bearer|basic|token|aws4-hmac-sha256|sharedkey)\s+(?P<cred>\S+)", re.I)
_ENV_SECRETS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
# `user:secret@host` with the scheme already cut off: how botocore and s3fs quote a bucket name
# parsed from such a URL ("Invalid bucket name \"KEY:SECRET@bucket\"")
_BARE_USERINFO = re.compile(r"(?<![\w/:@.+-])[^\s/@:'\"]+:[^\s/@'\"]+@(?=[\w.-])")

# Query parameters whose values are credentials (matched on the lower-cased name). The
# separator-joined forms catch `x-amz-security-token`, `access_token`, `client_secret`,
# `api_key`; the camel-case ones `accessToken`, `apiKey`. `pageToken`-style names that select
# data are deliberately not matched (url_identity drops what matches).
_SECRET_PARAM = re.compile(
    r"^(?:(?:[a-z0-9]+[-_])*(?:token|secret|password|passwd|pwd|key|apikey|credential|"
    r"credentials|signature|sig|auth|authorization|jwt)"
    r"|awsaccesskeyid|googleaccessid|accesstoken|idtoken|refreshtoken|sessiontoken|"
    r"securitytoken|authtoken|apikey|accesskey|secretkey|clientsecret)$")
# Parameters that are not secret but belong to a signature (its date, expiry, scope), so they
# change every time a URL is signed again: url_identity drops them with the secret ones. The
# SAS and SigV2 names only count where the query carries a signature (`sig`, `Signature`).
_SIGNING_PREFIXES = ("x-amz-", "x-goog-")
_SIGNED_ONLY = frozenset({
    # Azure SAS (account, service and user-delegation fields, response-header overrides)
    "sv", "ss", "srt", "sp", "se", "st", "spr", "sip", "si", "sr", "sdd", "ses", "skoid",
    "sktid", "skt", "ske", "sks", "skv", "saoid", "suoid", "scid",
    "rscc", "rscd", "rsce", "rscl", "rsct",
    # S3/GCS V2 signatures; `x-id` is the operation name newer AWS SDKs add to presigned URLs
    "expires", "x-id",
})
_QUERY_PARAM = re.compile(r"(?P<pre>[?&;](?P<name>[A-Za-z0-9_.~%-]+)=)(?P<val>[^&;#\s'\"<>]*)")


def secret_param(name: str) -> bool:
    """Whether a URL query parameter of this name carries a credential (its value is masked)."""
    return bool(_SECRET_PARAM.match(name.lower()))


def userinfo(url: str) -> str | None:
    """The `user:secret` part of a URL, or None."""
    m = re.match(r"^[a-z][a-z0-9+.-]*://([^/@\s]+)@", str(url), re.I)
    return m.group(1) if m else None


def mask_text(text: str) -> str:
    """`text` with URL userinfo and the values of query credentials masked (module docstring):
    a URL keeps its scheme, host, path and non-secret parameters. Works on a bare URL and on
    URLs inside longer text (an error message, a log line)."""
    text = _USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", str(text))
    text = _BARE_USERINFO.sub(REDACTED + "@", text)
    return _QUERY_PARAM.sub(
        lambda m: m.group("pre") + REDACTED if m.group("val") and secret_param(m.group("name"))
        else m.group(0), text)


def redact_url(url: str) -> str:
    """A URL (or path) fit for logs, errors and records: `mask_text` of it. The one definition
    (the pipeline imports it: the store is the lower layer)."""
    return mask_text(str(url))


def url_identity(url: str) -> str:
    """The secret-free identity of a source URL, for comparing configs across runs (the run's
    content key, which resume checks and the store records): userinfo and every credential or
    signing parameter of the query are dropped, not masked, everything else is kept verbatim.

    Dropped rather than masked because a presigned or SAS URL is signed again for every run (a
    new signature, date and expiry for the same object): masked, two signings of one object would
    differ in `X-Amz-Date` and a resume would be refused. The dropped parameters only prove the
    right to read; none selects what is read (`versionId`, `generation` and other parameters
    stay), so two sources that differ in data never compare equal through this. A URL with
    nothing to drop is returned unchanged, so the keys of stores made before this existed
    stay equal."""
    s = str(url)
    out = _USERINFO.sub(lambda m: m.group("scheme"), s) if "://" in s else s
    base, sep, rest = out.partition("?")
    if not sep:
        return out
    query, hash_sep, frag = rest.partition("#")
    params = [p for p in re.split(r"[&;]", query) if p]
    names = [p.split("=", 1)[0].lower() for p in params]
    signed = any(n in ("sig", "signature") for n in names)
    kept = [p for p, n in zip(params, names)
            if not (secret_param(n) or n.startswith(_SIGNING_PREFIXES)
                    or (signed and n in _SIGNED_ONLY))]
    if len(kept) == len(params):
        return out
    return base + ("?" + "&".join(kept) if kept else "") + hash_sep + frag


def url_origin(url: str) -> str:
    """`scheme://host/…`: all a message may say of a URL whose path itself is the secret (a
    Slack or Teams webhook: `https://hooks.slack.com/services/T0/B0/<secret>`)."""
    m = re.match(r"^([a-z][a-z0-9+.-]*://)(?:[^/@\s]*@)?([^/?#\s]*)", str(url), re.I)
    return f"{m.group(1)}{m.group(2)}/…" if m else REDACTED


def known_secrets(storage_options: dict | None = None) -> list[str]:
    """Secret strings currently in play: from storage_options (nested headers and client
    kwargs included) and the AWS environment."""
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
            m = _AUTH_SCHEME.match(obj)
            if m:
                out.append(m.group("cred"))

    walk(storage_options or {})
    # Longest first so a secret that contains another is removed whole.
    return sorted({s for s in out if len(s) >= 4}, key=len, reverse=True)


def scrub(text: str, storage_options: dict | None = None) -> str:
    """`mask_text`, and every known secret value (storage options, AWS environment) removed."""
    text = mask_text(text)
    for s in known_secrets(storage_options):
        text = text.replace(s, REDACTED)
    return text


def redact_attrs(obj: Any, storage_options: dict | None = None) -> Any:
    """Copy of a JSON-like tree with the string values of secret-looking keys replaced, every
    string masked (`mask_text`) and known secret values removed."""
    secrets = known_secrets(storage_options)

    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: (REDACTED if _SECRET_KEY_NAMES.search(str(k)) and isinstance(v, str) and v
                        else walk(v)) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v) for v in o]
        if isinstance(o, str):
            for s in secrets:
                o = o.replace(s, REDACTED)
            return mask_text(o)
        return o

    return walk(obj)


def redact_options(storage_options: dict | None) -> StorageOptions | None:
    """Storage options fit for a repr or a message: the same keys, the values of secret ones
    (and of auth headers, nested dicts included) masked, URLs masked; `endpoint_url`, region and
    timeouts stay readable."""
    if storage_options is None:
        return None
    return redact_attrs(dict(storage_options), storage_options)
