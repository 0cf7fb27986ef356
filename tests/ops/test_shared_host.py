"""Shared hosts (issue 51 item 4): vLLM's socket folder is never one another user made or a
symlink (engine/parallel.py), and the log folders and files harvest writes are private (0700,
0600: pipeline/logs.py)."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys

import pytest

from harvest.engine import parallel
from harvest.engine.parallel import (RPC_DIR_PREFIX, UnsafeTempDir, clear_rpc_dir,
                                     private_dir_problem, remove_stale_rpc_dirs, rpc_dir)
from harvest.pipeline.logs import new_log_dir, open_log, quiet_run, redirect_actor


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def fresh_rpc(monkeypatch):
    """rpc_dir as in a process that has not made its folder yet."""
    monkeypatch.setattr(parallel, "_RPC_DIRS", {})


def test_the_socket_folder_is_made_private(tmp_path, fresh_rpc):
    old = os.umask(0)   # even a permissive umask gives 0700
    try:
        path = rpc_dir(str(tmp_path))
    finally:
        os.umask(old)
    assert path == str(tmp_path / f"{RPC_DIR_PREFIX}{os.getpid()}")
    assert _mode(path) == 0o700 and private_dir_problem(path) is None
    assert rpc_dir(str(tmp_path)) == path          # one folder for the life of the process


def test_a_precreated_world_writable_folder_is_not_used(tmp_path, fresh_rpc):
    planted = tmp_path / f"{RPC_DIR_PREFIX}{os.getpid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    assert "mode is 0777" in private_dir_problem(str(planted))
    path = rpc_dir(str(tmp_path))
    assert path != str(planted) and os.path.basename(path).startswith(
        f"{RPC_DIR_PREFIX}{os.getpid()}-")
    assert _mode(path) == 0o700 and private_dir_problem(path) is None
    assert _mode(planted) == 0o777   # left alone, never chmod'ed or cleared
    assert parallel.own_rpc_dir(path) and not parallel.own_rpc_dir(str(tmp_path / "elsewhere"))


def test_a_symlink_at_the_name_is_not_followed(tmp_path, fresh_rpc):
    target = tmp_path / "attacker"
    target.mkdir(mode=0o700)
    (target / "keep").write_bytes(b"")
    link = tmp_path / f"{RPC_DIR_PREFIX}{os.getpid()}"
    link.symlink_to(target)
    assert "symlink" in private_dir_problem(str(link))
    path = rpc_dir(str(tmp_path))
    assert path != str(link) and not os.path.islink(path) and _mode(path) == 0o700
    assert clear_rpc_dir(str(link)) == [] and (target / "keep").exists()  # never through a link
    # the sweep leaves links and other users' names alone: a dead pid's link stays
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f"{RPC_DIR_PREFIX}{dead}").symlink_to(target)
    assert remove_stale_rpc_dirs(str(tmp_path)) == [] and (target / "keep").exists()


def test_a_folder_replaced_after_use_is_refused_by_name(tmp_path, fresh_rpc):
    path = rpc_dir(str(tmp_path))
    clear_rpc_dir(path)                     # an engine closed: the folder is gone
    os.mkdir(path)
    os.chmod(path, 0o777)                   # someone took the name meanwhile
    with pytest.raises(UnsafeTempDir, match=r"was replaced .* mode is 0777.*TMPDIR"):
        rpc_dir(str(tmp_path))
    os.rmdir(path)
    assert rpc_dir(str(tmp_path)) == path and _mode(path) == 0o700   # remade in place


def test_log_folders_and_files_are_private(tmp_path, monkeypatch):
    for name in ("harvest", "pipeline"):   # another test's console handler may be closed
        monkeypatch.setattr(logging.getLogger(name), "handlers", [])
    old = os.umask(0o022)
    try:
        d = new_log_dir(tmp_path / "cache", "run")
        assert _mode(d) == 0o700 and _mode(d.parent) == 0o700
        assert new_log_dir(tmp_path / "cache", "run") != d    # two runs in one second
        with quiet_run(d) as driver_log:
            os.write(1, b"third-party output\n")   # what a library writes to descriptor 1
        assert _mode(driver_log) == 0o600
        assert "third-party output" in driver_log.read_text()
        # an actor's file, in a folder another node makes
        monkeypatch.setenv("HARVEST_LOG_DIR", str(tmp_path / "node2" / "logs"))
        saved = os.dup(1), os.dup(2)
        try:
            path = redirect_actor(3)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        assert path is not None and _mode(path) == 0o600 and _mode(path.parent) == 0o700
    finally:
        os.umask(old)
    # an existing file is made private too; a symlink at a log's name is refused
    loose = tmp_path / "loose.log"
    loose.write_text("")
    os.chmod(loose, 0o644)
    os.close(open_log(loose))
    assert _mode(loose) == 0o600
    (tmp_path / "link.log").symlink_to(loose)
    with pytest.raises(OSError):
        open_log(tmp_path / "link.log")
