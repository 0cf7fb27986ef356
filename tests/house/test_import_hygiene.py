"""The torch-only parts run without vLLM and Ray (issue 28): the tap ops, the transport, row
coverage, the store's writer and the reader. The GPU host this project can reach has torch and no
vLLM, Ray or zarr wheels of its own; whatever is proven there must import and work with those
two absent. Here they are hidden by an import hook (installed, but any import of them fails), and
the unit tests of those parts run in that process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hidden import hiding

pytestmark = [pytest.mark.slow, pytest.mark.beside_engines]  # a pytest run in a subprocess

REPO = Path(__file__).resolve().parents[2]

HIDE = hiding("vllm", "ray")

MODULES = ("harvest.engine.capture.taps", "harvest.engine.capture.transport", "harvest.engine.capture.coverage",
           "harvest.engine.addresses", "harvest.engine.capture.block_stream", "harvest.store.write.writer",
           "harvest.store.read.dataset", "harvest.store.read.adapters")


def _python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE + code], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_the_hook_really_hides_vllm_and_ray():
    r = _python("import vllm")
    assert r.returncode != 0 and "is hidden from this process" in r.stderr, r.stderr[-2000:]


def test_taps_transport_coverage_writer_and_reader_import_and_work_without_vllm_or_ray():
    imports = "; ".join(f"import {m}" for m in MODULES)
    r = _python(f"{imports}\nprint(sorted(m for m in sys.modules if m.split('.')[0] in "
                "('vllm', 'ray')))")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr[-3000:]
    # the unit tests of row coverage, the transport and the store, where vLLM and Ray cannot load;
    # in this process (-n 0): xdist's workers (pyproject's addopts) would not inherit the hook
    r = _python("import pytest\nrc = pytest.main(['-q', '-p', 'no:cacheprovider', '-n', '0', "
                "'-m', 'not slow', '-k', 'not s3', 'tests/engine/test_engine_coverage.py', "
                "'tests/store/test_store_roundtrip.py'])\n"
                "print('ran here:', 'tests.engine.test_engine_coverage' in sys.modules, "
                "file=sys.stderr)\nsys.exit(rc)")
    assert "ran here: True" in r.stderr, r.stderr[-2000:]  # in this process, under the hook
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in tail and "failed" not in tail and "error" not in tail, tail
    assert int(tail.split(" passed")[0].split()[-1]) >= 20, tail
