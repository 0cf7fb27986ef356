"""Running the examples in `.venv-trainers` (sae-lens, dictionary-learning, sparsify and the light
harvest-store package, built by .ci/install-trainers), for test_reader_adapters.py and
test_saelens_parity.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRAINERS = REPO / ".venv-trainers" / "bin" / "python"


def trainers_python():
    if not TRAINERS.exists():
        pytest.fail(f"{TRAINERS} is missing: run `bash .ci/install`, which builds it (sae-lens, "
                    "dictionary-learning, eai-sparsify and the light harvest-store package)")
    return str(TRAINERS)


def run_example(python: str, script: str, store: str, *extra, light: bool = False, timeout: int = 600) -> dict:
    env = dict(os.environ, WANDB_MODE="disabled", TQDM_DISABLE="1", OMP_NUM_THREADS="2")
    if light:
        env["HARVEST_LIGHT"] = "1"   # import harvest.store from the installed package only
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = str(REPO)
    p = subprocess.run([python, str(REPO / "examples" / script), "--store", store, *extra], env=env,
                       capture_output=True, text=True, timeout=timeout, cwd=str(REPO / "examples"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])
