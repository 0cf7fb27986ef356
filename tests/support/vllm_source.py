"""The Python source of a vLLM release that is not installed, for compat_check.check_source:
its wheel from the package index (`pip download`, pip's own cache keeps it), unpacked once under
the harvest cache, the `vllm/` package's .py files only (no binaries)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from harvest.engine.models import cache_dir


def vllm_source(version: str) -> Path:
    """A folder holding vLLM `version`'s `vllm/` package source (built once, reused)."""
    root = cache_dir() / "vllm-src" / version
    done = root / ".complete"
    if done.exists():
        return root
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                            ":all:", "-d", tmp, f"vllm=={version}"], capture_output=True, text=True,
                           timeout=1200, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        wheels = list(Path(tmp).glob(f"vllm-{version}-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"pip could not fetch vllm=={version} from the package index: "
                               f"{(r.stderr or r.stdout)[-1500:]}")
        part = root.with_name(root.name + ".part")
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, part)
    if root.exists():
        import shutil

        shutil.rmtree(root)
    part.rename(root)
    done.write_text(version)
    return root
