"""A store made by someone else is hostile input: its text reaches HTML, Markdown and terminals
escaped (store/escape.py), a lone surrogate fails nothing, and a report is never written through
a symbolic link the store ships."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from harvest.pipeline.cli.main import main
from harvest.store.escape import html_text, md_code, md_text, plot_text, terminal, terminal_data

SCRIPT = "<script>alert('store')</script>"
ANSI = "\x1b[2J\x1b[31m"
# every kind of trouble at once: markup, table pipes, backticks, ANSI, \r, a C1 CSI, a bidi
# override, a newline, and a lone surrogate (valid JSON as \udc80, unencodable as UTF-8)
EVIL = f"{SCRIPT} | `tick` {ANSI}red\rover\x9b2J \u202eevil\nline \udc80 $x$ & [l](j:x)"


@pytest.fixture
def hostile(tmp_path):
    """A small real store, finalized, whose attributes and run summary hold EVIL everywhere the
    card, the report, `inspect` and `status` show the maker's text."""
    from tests.support.reader_stores import make_store

    url = tmp_path / "hostile.zarr"
    s, *_ = make_store(url, 1024, 256, points=("resid_post.0", "resid_post.2"), context=64, attrs={
        "model": {"model": EVIL, "backend": EVIL, "mode": EVIL},
        "config": {"model": {"path": EVIL, "backend": EVIL},
                   "packing": {"context_size": 64, "note": EVIL}},
        "provenance": {"data": {"resolved": EVIL, "split": EVIL, "column": "a|b`c`",
                                "fingerprint": EVIL},
                       "model": {"revision": EVIL},
                       "harvest": {"version": EVIL, "config_sha256": EVIL},
                       "token_source": {"column": EVIL, "tokenizer_name": EVIL}}})
    # the finalize summary: a string where numbers belong too
    s.finalize({"status": EVIL, "finished_at": EVIL, "compression_ratio": EVIL,
                "tokens_per_second": EVIL, "bytes_stored": EVIL,
                "per_actor": [{"index": EVIL, "tokens_per_second": EVIL, "step_fill": EVIL}]})
    return url


def _no_controls(text: str) -> None:
    """No control character but newlines, no bidi override, no lone surrogate."""
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", text), repr(text[:200])
    text.encode("utf-8")


def _no_raw(text: str) -> None:
    """Markup output: that, and no `<script` anywhere."""
    assert "<script" not in text.lower()
    _no_controls(text)


def test_finalize_writes_the_card_of_a_store_whose_attributes_hold_a_lone_surrogate(hostile):
    """Finalize wrote README.md (it failed with UnicodeEncodeError after writing the attributes);
    the front matter reads back as YAML to the very strings of the attributes; the body shows
    them escaped, every table row keeps its two columns."""
    text = (hostile / "README.md").read_text(encoding="utf-8")
    _no_raw(text)
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["harvest"]["model"] == EVIL and front["pretty_name"].startswith(EVIL)
    body = text.split("---\n", 2)[2]
    assert "&lt;script&gt;" in body
    table = [ln for ln in body.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(table) >= 8
    for ln in table:   # cell separators: pipes not escaped by a backslash
        cells = re.split(r"(?<!\\)\|", ln)
        assert len(cells) in (4, 8), ln   # two columns, or the statistics table's six
    assert md_text(EVIL) in body and md_code(EVIL) in body


def test_card_command_rewrites_the_card_escaped(hostile, capsys):
    assert main(["card", str(hostile), "--print"]) == 0
    out = capsys.readouterr().out
    _no_raw(out)
    assert "\x1b" not in out and md_text(EVIL) in out


def test_report_escapes_the_stores_text(hostile, capsys):
    assert main(["report", str(hostile)]) == 0
    capsys.readouterr()
    page = (hostile / "_report" / "report.html").read_text(encoding="utf-8")
    _no_raw(page)
    assert html_text(EVIL) in page            # the run's status, escaped, in the runs table
    assert "&lt;script&gt;alert(&#x27;store&#x27;)&lt;/script&gt;" in page
    rep = json.loads((hostile / "_report" / "report.json").read_text(encoding="ascii"))
    assert rep["run"]["runs"][0]["status"] == EVIL   # data kept exact, as JSON escapes
    assert rep["run"]["runs"][0]["tokens_per_second"] is None   # a string is not a rate
    assert not [f for f in os.listdir(hostile / "_report") if f.endswith(".tmp")]


def test_inspect_and_status_print_no_control_characters(hostile, capsys):
    for cmd in (["inspect", str(hostile)], ["status", str(hostile)], ["verify", str(hostile)]):
        assert main(cmd) == 0, cmd
        out = capsys.readouterr().out
        _no_controls(out)
    assert main(["inspect", str(hostile)]) == 0
    assert terminal(EVIL) in capsys.readouterr().out   # shown, escaped
    assert main(["status", str(hostile)]) == 0
    out = capsys.readouterr().out
    assert terminal(EVIL) in out and "? tok/s" in out   # the summary's status... and no rate
    # --json: JSON's own escapes (ASCII), the values exact
    assert main(["inspect", str(hostile), "--json"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and json.loads(out)["attrs"]["model"]["model"] == EVIL


def test_the_light_clis_inspect_and_verify_print_no_control_characters(hostile, capsys):
    from harvest.store.cli import main as store_main

    for cmd in (["inspect", str(hostile)], ["verify", str(hostile)]):
        assert store_main(cmd) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\r" not in out
        out.encode("utf-8")


def test_a_symlinked_report_dir_is_refused_and_nothing_is_written_through_it(hostile, tmp_path,
                                                                              capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (hostile / "_report").symlink_to(elsewhere, target_is_directory=True)
    assert main(["report", str(hostile)]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and str(hostile / "_report") in err and "--out" in err
    assert os.listdir(elsewhere) == []
    # a link at one of the files inside a real report directory: refused too, target untouched
    os.unlink(hostile / "_report")
    (hostile / "_report").mkdir()
    victim = tmp_path / "victim.html"
    victim.write_text("mine")
    (hostile / "_report" / "report.html").symlink_to(victim)
    assert main(["report", str(hostile)]) == 2
    err = capsys.readouterr().err
    assert "report.html" in err and "symbolic link" in err
    assert victim.read_text() == "mine"
    assert sorted(os.listdir(hostile / "_report")) == ["report.html"]   # nothing else written


def test_the_escapes_themselves():
    assert terminal("a\x1b[2Jb\r\n\x9b\u202e\udc80") == "a\\x1b[2Jb\\r\\n\\x9b\\u202e\\udc80"
    assert terminal("a\nb\x1b", newlines=True) == "a\nb\\x1b"
    assert html_text("<a href='x'>&\"") == "&lt;a href=&#x27;x&#x27;&gt;&amp;&quot;"
    assert md_text("a|b`c`<d>*e*_f_[g](h)#!&\\") == \
        "a\\|b\\`c\\`&lt;d&gt;\\*e\\*\\_f\\_\\[g\\](h)\\#\\!&amp;\\\\"
    assert md_code("x`y|<z>") == "<code>x\\`y\\|&lt;z&gt;</code>"
    assert md_text("resid_post.3 _x_ a__b_") == "resid_post.3 \\_x\\_ a__b\\_"
    assert plot_text("$5 and $6\x1b") == "\\$5 and \\$6\\x1b"
    assert terminal_data({"k\x1b": ["v\r", 3, None]}) == {"k\\x1b": ["v\\r", 3, None]}
