"""`harvest-store verify|inspect`, the light install's commands, in a process without torch.

An SAE trainer's environment installs harvest-store without torch (a multi-GB CUDA build by
default); checking a store before training on it must work there, with the same verdicts as
`harvest verify`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harvest.store.format import layout
from tests.support.hidden import hiding
from tests.support.reader_stores import make_store

pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]  # the command in subprocesses

REPO = Path(__file__).resolve().parents[2]
N, SHARD, W, CTX = 1024, 256, 16, 64

NO_TORCH = hiding("torch", "vllm", "ray") + """
from harvest.store.cli import main
rc = main(sys.argv[1:])
assert "torch" not in sys.modules
sys.exit(rc)
"""


def _store_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "s.zarr"
    s, data, tok, doc, pos = make_store(path, N, SHARD, width=W, points=("resid_post.0",),
                                        context=CTX)
    return str(path), tok


def test_verify_and_inspect_run_without_torch(store):
    path, tok = store
    r = _store_cli("verify", path, "--deep")
    assert r.returncode == 0 and r.stdout.startswith(f"{path}: OK: 4 of 4 units, 1,024 of 1,024"), \
        r.stdout + r.stderr[-3000:]
    r = _store_cli("inspect", path, "--rows", "5:9", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["rows"]["token_id"] == tok[5:9].tolist() and got["n_rows"] == N


def test_verify_without_torch_finds_a_deleted_shard(store):
    path, _ = store
    os.remove(os.path.join(path, layout.shard_object_key("resid_post.0", 2)))
    assert _store_cli("verify", path).returncode == 0            # lists nothing: cannot see it
    for flag in ("--objects", "--deep"):
        r = _store_cli("verify", path, flag)
        assert r.returncode == 1 and "FAILED" in r.stdout, (flag, r.stdout, r.stderr[-2000:])
    r = _store_cli("verify", str(Path(path).parent / "nothing-here"))
    assert r.returncode == 2 and "harvest-store verify:" in r.stderr, r.stderr[-2000:]


def test_the_light_package_needs_no_torch_and_ships_the_command():
    meta = tomllib.loads((REPO / "packages/harvest-store/pyproject.toml").read_text())["project"]
    assert not [d for d in meta["dependencies"] if d.lower().startswith("torch")]
    assert any(d.startswith("torch") for d in meta["optional-dependencies"]["torch"])
    assert meta["scripts"]["harvest-store"] == "harvest.store.cli:main"
