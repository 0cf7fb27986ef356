"""benchmarks/gpu/torch_check.py cannot rot before a GPU is at hand: its dry mode runs here, on CPU.

The dry run compiles a tiny Llama trunk with the freeze taps (torch.compile, aot_eager on CPU; CUDA
graphs do not) and compares every tapped row with harvest's hooked-mode eager rows for real; the
transport loop, the writer and the reader run at tiny shapes; what needs CUDA must say so.
No vLLM and no Ray: no lock needed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harvest.benchmarks.gpu import torch_transport as gtt
from harvest.benchmarks.gpu.torch_taps import STALE_MIN, TOL
from tests.support.hidden import hiding

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.beside_engines  # torch only: no vLLM engine, no Ray
NEEDS_CUDA = "skipped: needs CUDA"


@pytest.mark.slow  # a compile and a writer/reader run, in subprocesses
def test_dry_run_reports_every_part_and_compares_taps_for_real(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as on the GPU host: no install
    r = subprocess.run([sys.executable, "benchmarks/gpu/torch_check.py", "--dry", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads((tmp_path / "gpu_torch_check.json").read_text())
    assert doc["dry"] is True and set(doc["parts"]) == {"taps", "transport", "writer", "reader"}
    for name, part in doc["parts"].items():   # a result, or a skip that says why: never silent
        assert part["status"] == "ok" or (part["status"].startswith("skipped: ") and
                                          len(part["status"]) > 12), (name, part)
    taps = doc["parts"]["taps"]
    assert taps["status"] == "ok" and taps["cuda_graphs"] == NEEDS_CUDA
    assert taps["graph_vs_no_graph_bitwise"] == NEEDS_CUDA
    want = {f"resid_post.{i}" for i in range(taps["layers"])} | {"resid_pre.0"}
    assert want <= set(taps["worst_rel_err"]) and len(taps["worst_rel_err"]) == len(want) + 2
    # every tapped row of every point was compared with the eager rows, and a stale row could not pass
    assert all(isinstance(e, float) and e <= TOL for e in taps["worst_rel_err"].values()), taps
    assert taps["replays"] == 2 * len(taps["batches"]) and taps["min_rel_dist_to_other_input"] > STALE_MIN
    assert taps["compile_tapped_s"] > 0 and not taps["failures"]
    tr = doc["parts"]["transport"]
    assert tr["CudaTransport"] == NEEDS_CUDA and tr["cpu"]["bad_rows"] == 0
    assert tr["cpu"]["rows_checked"] > 0 and tr["cpu"]["achieved_d2h_gbs"] == NEEDS_CUDA
    assert doc["parts"]["writer"]["verify_deep"] == "OK"
    assert doc["parts"]["writer"]["core_s_per_gb"] > 0
    rd = doc["parts"]["reader"]
    assert rd["pin_memory"] == NEEDS_CUDA and rd["rows_trained"] > 0 and rd["sae_demand_rows_s"] > 0
    md = (tmp_path / "gpu_torch_check.md").read_text()
    assert all(f"## {p}: " in md for p in doc["parts"])


def test_transport_checksums_catch_torn_stale_and_unwritten_rows():
    """The row check the GPU run relies on fails for each way a row can go wrong."""
    from harvest.engine.capture.transport import CPUTransport

    geo = gtt.DRY_GEOMETRY
    loop = gtt.Loop(geo, torch.device("cpu"))
    tr = CPUTransport()
    dests = {rid: tr.new_destination((geo["points"], geo["request"], geo["width"]), torch.bfloat16)
             for rid in loop.reqs}
    for d in dests.values():
        d.view(torch.int16).fill_(gtt.SENTINEL)
    res = gtt.run_loop(loop, tr, dests, list(range(geo["points"])))
    rows = geo["points"] * sum(len(t) for t in loop.reqs.values())
    assert gtt.verify(loop, dests, res["plans"]) == {"rows_checked": rows, "bad_rows": 0}
    d = dests["r1"]
    d[0, 3, : geo["width"] // 2] = d[0, 4, : geo["width"] // 2]     # torn: half of another row
    d[1, 5] = d[1, 6]                                                # stale/misplaced: another row
    d[2, 7].view(torch.int16).fill_(gtt.SENTINEL)                    # never written
    assert gtt.verify(loop, dests, res["plans"])["bad_rows"] == 3


def test_the_fp8_transport_loop_delivers_every_packed_row_and_its_check_can_fail():
    """fp8 capture through the transport loop (CPU here; CudaTransport on the GPU host): every
    packed row bit for bit the quantiser's, and a wrong byte or a row of another step is caught."""
    res = gtt.run(dry=True)
    q = res["fp8_cpu"]
    assert res["ok"] and q["bad_rows"] == 0 and q["rows_checked"] == res["cpu"]["rows_checked"]
    from harvest.engine.capture.transport import CPUTransport

    geo = gtt.DRY_GEOMETRY
    loop = gtt.Loop(geo, torch.device("cpu"))
    tr = CPUTransport()
    dests = {rid: tr.new_destination((geo["points"], geo["request"], geo["width"] + 4), torch.uint8)
             for rid in loop.reqs}
    r = gtt.run_loop(loop, tr, dests, list(range(geo["points"])), quantize=True)
    assert gtt.verify_quantized(loop, dests, r["plans"])["bad_rows"] == 0
    d = dests["r1"]
    d[0, 3, 0] ^= 1                 # one value's bits
    d[1, 5, -1] ^= 0x40             # the scale
    d[2, 7] = d[2, 8]               # another row
    assert gtt.verify_quantized(loop, dests, r["plans"])["bad_rows"] == 3


@pytest.mark.slow  # a subprocess with zarr hidden
def test_without_zarr_the_store_parts_are_explicit_skips():
    code = hiding("zarr") + ("import json\nfrom harvest.benchmarks.gpu import torch_store as g\n"
                             "print(json.dumps([g.writer(True), g.reader(True)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    w, rd = json.loads(r.stdout.strip().splitlines()[-1])
    assert w == rd == {"status": "skipped: no zarr (install the wheels of .gpu-wheels: docs/benchmarks.md)"}


@pytest.mark.slow  # imports the store in a clean subprocess
def test_the_wheels_script_covers_what_the_store_imports():
    """Every third-party module the writer/reader/verify chain imports, beyond torch and numpy
    (the GPU host has those), is in benchmarks/gpu/torch_check.sh's list, or the GPU run dies on import."""
    code = ("import sys\nimport harvest.store.write.writer, harvest.store.read.dataset, "
            "harvest.store.commit.verify, harvest.store.read.adapters\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = set(r.stdout.split()) - set(sys.stdlib_module_names)
    # torch and its own (optional) imports, present wherever torch is; our package; Cython's
    # interpreter-level module
    host = {"torch", "torchgen", "numpy", "harvest", "sympy", "mpmath", "networkx", "jinja2",
            "markupsafe", "filelock", "dill", "tqdm", "cython_runtime"}
    listed = {m.split(".")[0] for m in re.findall(
        r"([\w.]+):", (REPO / "benchmarks" / "gpu" / "torch_check.sh").read_text()
        .split('PKGS="', 1)[1].split('"', 1)[0])}
    missing = {m for m in loaded - host - listed if not m.startswith("_")}
    assert not missing, f"add to PKGS in benchmarks/gpu/torch_check.sh: {sorted(missing)}"
