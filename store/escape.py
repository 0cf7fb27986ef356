"""Escaping of strings that come from a store (or a dataset), for HTML, Markdown and terminals.

A store made by someone else is hostile input: its attributes (a run summary's `status`, the
model path, a dataset name, tick records, commit-marker fields) are free text, and may hold
markup (`<script>`), Markdown syntax (`|` ending a table cell, backticks ending a code span, a
newline ending a table row), terminal control sequences (`ESC [2J` clears the screen, `\\r`
rewrites a line, C1 controls are escapes of their own on some terminals) and lone surrogates
(JSON's `\\udc80` reads back as a str that no UTF-8 writer accepts: writing it raises). Every
writer of HTML (`harvest report`), Markdown (the dataset card) and terminal text (`inspect`,
`status`, `verify`, error lines) passes such strings through the one function for its medium:

- `terminal(s)`: control characters shown as escapes (`\\x1b`, `\\r`, `\\n`, `\\u202e`), so a
  store cannot move the cursor, clear or recolour the screen or reorder text; `newlines=True`
  keeps `\\n` for text whose layout is made of lines (a message printed whole);
  `terminal_data(obj)` applies it to every string of a JSON-like value (keys too).
- `html_text(s)`: `html.escape(..., quote=True)`, for element text and attribute values alike.
- `md_text(s)`: Markdown text and table cells: controls and newlines escaped, Markdown syntax
  backslash-escaped (`\\|`, `` \\` ``, `\\*`, ...), and `& < >` as HTML entities, which every
  Markdown renderer shows as the characters and none reads as a tag.
- `md_code(s)`: `s` in monospace: `<code>` around `md_text(s)` (a backtick code span shows `<`
  literally, so a raw `<script>` would sit in the file; and GFM splits table cells on `|`
  before it sees code spans).
- `json_value(v)`: JSON text of `v` in ASCII (YAML front matter reads it as is): controls, lone
  surrogates and `< > &` as `\\uXXXX` escapes.
- `plot_text(s)`: text for a matplotlib figure: controls escaped, `$` escaped (matplotlib reads
  `$...$` as math, and a malformed formula fails the whole figure).

All of them first make a str writable as UTF-8 (`writable`): lone surrogates become the
visible text `\\udc80`. This module is in the store package (the lowest layer), so the store's
card and the pipeline's views share it.
"""

from __future__ import annotations

import html
import json
import re

# C0 controls, DEL, C1 controls; Unicode line/paragraph separators, bidirectional embeddings,
# overrides and isolates (they reorder what a terminal or a browser shows), the BOM/zero-width
# no-break space
_OTHER_CONTROLS = r"\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff"
_CONTROL = re.compile(rf"[\x00-\x1f{_OTHER_CONTROLS}]")
_CONTROL_BUT_NEWLINE = re.compile(rf"[\x00-\x09\x0b-\x1f{_OTHER_CONTROLS}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# what CommonMark/GFM (and HF's KaTeX) give a meaning to anywhere in a line (`& < >` become
# entities instead); `-`, `+`, `.`, `(`, `)` only matter at a line's start or after `]`, which
# md_text never leaves unescaped; `_` between two word characters opens and closes nothing
# (CommonMark's flanking rules), so `resid_post.3` stays as it is
_MD_SPECIAL = re.compile(r"([\\`*{}\[\]|#!~$])")
_MD_UNDERSCORE = re.compile(r"(?<!\w)_|_(?!\w)")


def writable(s) -> str:
    """`str(s)` with lone surrogates as the text `\\udXXX`: encodable as UTF-8."""
    s = s if isinstance(s, str) else str(s)
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _escape_control(m: re.Match) -> str:
    c = m.group(0)
    if c in _NAMED:
        return _NAMED[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def terminal(s, newlines: bool = False) -> str:
    """`s` safe to print: control characters (ANSI escape sequences' ESC, `\\r`, C1, bidi
    overrides) shown as backslash escapes; `\\n` kept where `newlines` (a multi-line message)."""
    return (_CONTROL_BUT_NEWLINE if newlines else _CONTROL).sub(_escape_control, writable(s))


def terminal_data(obj):
    """A JSON-like value with `terminal` applied to every string in it, dict keys included
    (newlines escaped: a value is one field of a line)."""
    if isinstance(obj, str):
        return terminal(obj)
    if isinstance(obj, dict):
        return {terminal_data(k): terminal_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [terminal_data(v) for v in obj]
    return obj


def html_text(s) -> str:
    """`s` as HTML text or a quoted attribute value: `& < > " '` as entities, controls escaped."""
    return html.escape(terminal(s, newlines=True), quote=True)


def md_text(s) -> str:
    """`s` as literal Markdown text, also inside a GFM table cell: controls and newlines as
    backslash escapes, Markdown syntax backslash-escaped, `& < >` as entities."""
    s = _MD_UNDERSCORE.sub(r"\\_", _MD_SPECIAL.sub(r"\\\1", terminal(s)))
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def md_code(s) -> str:
    """`s` shown literally in monospace, in Markdown text or a GFM table cell."""
    return f"<code>{md_text(s)}</code>"


def json_value(v) -> str:
    """JSON text of `v`, ASCII only: controls, lone surrogates and `< > &` as `\\uXXXX` escapes
    (the same value to a JSON or YAML reader; no markup to a renderer that shows it as text)."""
    text = json.dumps(v, ensure_ascii=True, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def plot_text(s) -> str:
    """`s` as literal matplotlib text: controls escaped, `$` as `\\$` (no math mode)."""
    return terminal(s).replace("$", "\\$")
