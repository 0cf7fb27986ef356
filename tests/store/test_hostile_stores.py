"""A store is untrusted input: every command and the reader, against crafted stores.

Each case starts from a real store (made by the writer, finalized), copies it, and plants one
hostile thing: a traversal in a marker's attempt or in an object table's metadata name, a table
key naming another object, a gzip bomb as a table or as an index segment, sizes past the layout
(a row range, the geometry), a plan of strings, a symlink at a shard's key, a compression bomb as
a metadata chunk. Then `harvest verify [--deep]`, `finalize`, `status`, `inspect`, `report`,
`card`, `shuffle`, `uncommit` and the SAE reader run on it, in this process, and for each:

- nothing outside the store is read, written or moved: a Python audit hook records every path
  opened, renamed, linked or removed, and none may lie in the folder of victim files next to the
  store (which the plants point at); the victims are unchanged;
- memory stays bounded (tracemalloc's peak), bombs included;
- no traceback: the command returns an exit code; the ones that must read the hostile record
  exit 2 (verify: 1, "FAILED", its code for a damaged store), and their message names the
  object and the field.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest

from harvest.pipeline.cli.main import main as harvest
from harvest.store import StoreError, open_store
from tests.support.reader_stores import make_store

MEM_BOUND = 96 << 20   # tracemalloc peak of any one command (the store itself is ~20 KB)
VICTIM = b"secret of another user\n"

# every path the process touches while `_watching` is on
_seen: list[str] = []
_watching = [False]


def _hook(event, args):
    if not _watching[0]:
        return
    if event == "open":
        paths = [args[0]]
    elif event in ("os.rename", "os.link", "os.symlink"):
        paths = [args[0], args[1]]
    elif event in ("os.remove", "os.rmdir", "os.mkdir", "os.listdir", "os.scandir", "shutil.rmtree",
                   "shutil.copyfile", "shutil.move"):
        paths = [args[0]]
    else:
        return
    for p in paths:
        if isinstance(p, (str, bytes, os.PathLike)):
            _seen.append(os.path.realpath(os.fsdecode(p)))


sys.addaudithook(_hook)


@contextlib.contextmanager
def watched():
    _seen.clear()
    _watching[0] = True
    tracemalloc.start()
    try:
        yield _seen
    finally:
        _watching[0] = False
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        watched.peak = peak


# ---- the base store and the plants ---------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile") / "base"
    s, *_ = make_store(d, 512, 128, width=16, points=("resid_post.0", "resid_post.1"))
    s.finalize()
    return d


def _json(p: Path):
    return json.loads(p.read_bytes())


def _put_json(p: Path, body) -> None:
    p.write_bytes(json.dumps(body, separators=(",", ":")).encode())


def _marker(d: Path, unit: int) -> Path:
    return next((d / "_harvest" / "commits").glob(f"unit-{unit:08d}.*.json"))


def _drop_index(d: Path) -> None:
    """The index is a cache of the markers: without it every marker is read as planted."""
    shutil.rmtree(d / "_harvest" / "index")


def _retable(d: Path, unit: int, blob: bytes) -> None:
    """Replace unit's object table by `blob`, its marker's digest and size made to match."""
    mp = _marker(d, unit)
    m = _json(mp)
    (d / m["table"]["key"]).write_bytes(blob)
    m["table"].update(sha256=hashlib.sha256(blob).hexdigest(), nbytes=len(blob))
    _put_json(mp, m)
    _drop_index(d)


def _unpublish(d: Path, unit: int) -> None:
    for p in (d / "_harvest" / "published").glob(f"unit-{unit:08d}.*.json"):
        p.unlink()


def _to_victim(d: Path, outside: Path) -> str:
    return os.path.relpath(outside / "victim", d)


def attempt_traversal(d, outside):
    """The marker carries its shard records inline (as layout-2 markers do, which harvest still
    reads), so no table pins the attempt; publishing (finalize: the publish record is gone)
    would move `<objects>/<point>/0.<attempt>`, which resolves to the victim, into the store."""
    mp = _marker(d, 0)
    m = _json(mp)
    m["shards"] = json.loads(gzip.decompress((d / m.pop("table")["key"]).read_bytes()))["shards"]
    m["attempt"] = "x/" + _to_victim(d / "_harvest" / "objects" / "resid_post" / "0", outside)
    m.pop("stats", None)
    _put_json(mp, m)
    _unpublish(d, 0)
    _drop_index(d)
    return mp.name, "attempt"


def table_key_elsewhere(d, outside):
    mp = _marker(d, 1)
    m = _json(mp)
    m["table"]["key"] = "_harvest/tables/" + _to_victim(d / "_harvest" / "tables", outside)
    _put_json(mp, m)
    _drop_index(d)
    return mp.name, "table.key"


def meta_name_traversal(d, outside):
    m = _json(_marker(d, 2))
    body = json.loads(gzip.decompress((d / m["table"]["key"]).read_bytes()))
    sh = body["shards"][0]
    sh["meta"]["../../" + _to_victim(d, outside)] = sh["meta"].pop("token_id")
    _retable(d, 2, gzip.compress(json.dumps(body).encode(), mtime=0))
    _unpublish(d, 2)
    return m["table"]["key"], "meta"


def _gzip_zeros(n: int) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    out = io.BytesIO()
    for _ in range(n >> 20):
        out.write(z.compress(chunk))
    out.write(z.flush())
    return out.getvalue()


def table_bomb(d, outside):
    _retable(d, 3, _gzip_zeros(512 << 20))
    return "unit-00000003", "table.nbytes"


def index_bomb(d, outside):
    seg = next((d / "_harvest" / "index").glob("idx-*.jsonl.gz"))
    seg.write_bytes(_gzip_zeros(512 << 20))
    return seg.name, "(line)"


def row_range_huge(d, outside):
    mp = _marker(d, 1)
    m = _json(mp)
    m["row_end"] = 1 << 62
    mp.unlink()
    _put_json(mp.with_name(f"unit-00000001.128-{1 << 62}.json"), m)
    _drop_index(d)
    return "unit-00000001.128-", "row_end"


def geometry_huge(d, outside):
    z = _json(d / "zarr.json")
    z["attributes"]["harvest"]["shard_rows"] = 1 << 40
    _put_json(d / "zarr.json", z)
    return "zarr.json", "shard_rows"


def plan_of_strings(d, outside):
    seg = next((d / "_harvest" / "plan").glob("seg-*.json"))
    body = _json(seg)
    body["units"][0][0] = "../../" + _to_victim(d, outside)
    _put_json(seg, body)
    return seg.name, "units[0]"


def shard_symlink(d, outside):
    obj = d / "resid_post" / "0" / "c" / "1" / "0"
    obj.unlink()
    obj.symlink_to(outside / "victim")
    return "resid_post/0/c/1/0", "outside the store"


def meta_chunk_bomb(d, outside):
    codec = open_store(str(d)).meta_codec("token_id")
    if codec is None:
        pytest.skip("token_id is not coded by harvest's MetaCodec in this store")
    bomb = codec._comp.encode(np.zeros(64 << 20, np.uint8).tobytes()) if codec._comp else None
    if bomb is None:
        pytest.skip("token_id is stored uncompressed")
    (d / "token_id" / "c" / "0").write_bytes(bomb)
    m = _json(_marker(d, 0))
    body = json.loads(gzip.decompress((d / m["table"]["key"]).read_bytes()))
    import google_crc32c

    rec = body["shards"][0]["meta"]["token_id"]
    rec.update(nbytes=len(bomb), crc32c=google_crc32c.value(bomb))
    _retable(d, 0, gzip.compress(json.dumps(body).encode(), mtime=0))
    return "token_id", "decoded"


CASES = {f.__name__: f for f in (attempt_traversal, table_key_elsewhere, meta_name_traversal,
                                 table_bomb, index_bomb, row_range_huge, geometry_huge,
                                 plan_of_strings, shard_symlink, meta_chunk_bomb)}
# what each case must make refuse (exit 2): the commands that read the planted record
READS_MARKERS = {"verify", "verify --deep", "finalize", "status", "shuffle", "reader"}
READS_OBJECTS = {"verify --deep", "finalize", "shuffle", "reader"}
# (finalize on a finalized store whose units are all published reads no marker or table: it has
# nothing to do; the cases that unpublish a unit make it read them)
MUST_REFUSE = {
    "attempt_traversal": READS_MARKERS, "table_key_elsewhere": READS_MARKERS - {"finalize"},
    "meta_name_traversal": READS_OBJECTS, "table_bomb": READS_OBJECTS - {"finalize"},
    "index_bomb": READS_MARKERS - {"finalize"}, "row_range_huge": READS_MARKERS,
    "geometry_huge": READS_MARKERS | {"inspect", "uncommit"},
    "plan_of_strings": {"verify", "status", "finalize"},
    "shard_symlink": {"verify --deep", "shuffle", "reader"},
    "meta_chunk_bomb": {"verify --deep", "shuffle", "reader"},
}
COMMANDS = ("verify", "verify --deep", "finalize", "status", "inspect", "report", "card",
            "shuffle", "uncommit", "reader")


@pytest.fixture(params=sorted(CASES))
def hostile(request, base, tmp_path):
    """(case, a function making a fresh copy of the planted store, the victims' folder, (the
    object and the field a refusal must name)): each command gets its own copy, so what one
    command repairs or removes never changes what the next one sees."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(VICTIM)
    planted = tmp_path / "planted"
    shutil.copytree(base, planted, symlinks=True)
    names = CASES[request.param](planted, outside)
    n = iter(range(100))

    def fresh() -> Path:
        d = tmp_path / f"store{next(n)}"
        shutil.copytree(planted, d, symlinks=True)
        return d
    return request.param, fresh, outside, names


def _run(cmd: str, d: Path, tmp: Path, capsys) -> "tuple[int, str]":
    if cmd == "reader":
        from harvest.store.read.dataset import ActivationDataset

        try:
            ds = ActivationDataset(open_store(str(d)), points=["resid_post.0"], batch_size=64,
                                   seed=0, exclude_token_ids=[1])
            for _ in ds:
                pass
            return 0, ""
        except StoreError as e:
            return 2, str(e)
    argv = {"verify": ["verify", str(d)], "verify --deep": ["verify", str(d), "--deep"],
            "finalize": ["finalize", str(d)], "status": ["status", str(d)],
            "inspect": ["inspect", str(d)], "report": ["report", str(d), "--out", str(tmp / "rep")],
            "card": ["card", str(d)], "shuffle": ["shuffle", str(d), str(tmp / "copy")],
            "uncommit": ["uncommit", str(d), "--unit", "2"]}[cmd]
    rc = harvest(argv)
    out = capsys.readouterr()
    return rc, out.err + out.out


def test_every_command_refuses_a_hostile_store_and_touches_nothing_outside(hostile, tmp_path,
                                                                           capsys):
    case, fresh, outside, (obj, field) = hostile
    for cmd in COMMANDS:
        d = fresh()
        with watched() as seen:
            rc, text = _run(cmd, d, tmp_path, capsys)
        assert isinstance(rc, int), (case, cmd)
        touched = [p for p in seen if p == str(outside) or p.startswith(str(outside) + os.sep)]
        assert not touched, (case, cmd, "touched outside the store", touched[:5])
        assert (outside / "victim").read_bytes() == VICTIM, (case, cmd)
        assert watched.peak < MEM_BOUND, (case, cmd, f"peak {watched.peak >> 20} MiB")
        assert "Traceback" not in text, (case, cmd, text[-2000:])
        if cmd in MUST_REFUSE[case]:
            # verify reports damage with its own exit code (1: the store failed verification)
            # and finalize too (1: what it could not publish is uncommitted, to re-capture)
            assert rc == 2 or (rc == 1 and cmd.split()[0] in ("verify", "finalize")), \
                (case, cmd, rc, text[-2000:])
            assert obj in text and field in text, (case, cmd, obj, field, text[-2000:])
        else:
            assert rc in (0, 1, 2), (case, cmd, rc)
