#!/usr/bin/env bash
# gpu_torch_check on a GPU host that has torch but no zarr (and no network): docs/benchmarks.md.
#
#   bash benchmarks/gpu/torch_check.sh wheels     # here, with network: fills .gpu-wheels/ (< 64 MiB)
#   bash benchmarks/gpu/torch_check.sh run OUT    # on the GPU host, from the checkout root
#
# `wheels` downloads, for CPython 3.12 on manylinux x86_64, exactly the packages the store's
# writer and reader import beyond torch and numpy (--no-deps: a resolver would also fetch numpy,
# ~16 MB, which the host has). Versions are the ones this checkout is tested with.
#
# `run` installs into .gpu-site/ (a --target folder, not the host's site-packages: the host's own
# packages stay as they are and PEP 668 "externally managed" pythons do not refuse it) only the
# wheels whose module the host cannot import already (the host's tensorstore brings its own
# ml_dtypes, which must not be shadowed), then runs the check with the checkout on PYTHONPATH
# (no `pip install -e` there: harvest/__init__.py maps harvest.* to the checkout's folders).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.gpu-wheels
# module name : requirement (pins: the versions this checkout is tested with)
PKGS="zarr:zarr==3.1.6 numcodecs:numcodecs==0.16.6 donfig:donfig==0.8.1.post1
google_crc32c:google-crc32c==1.9.0 ml_dtypes:ml_dtypes==0.7.0 msgpack:msgpack==1.2.4
yaml:PyYAML==6.0.4 fsspec:fsspec==2026.9.0 typing_extensions:typing_extensions==4.16.0
packaging:packaging==26.4 backports.zstd:backports-zstd==1.8.0 crc32c:crc32c==2.9.post0"

case "${1:-}" in
wheels)
    PIP=${PIP:-.venv/bin/pip}
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    reqs=$(for p in $PKGS; do echo "${p#*:}"; done)
    # shellcheck disable=SC2086
    $PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
        -d "$WHEELS" $reqs
    kib=$(du -sk "$WHEELS" | cut -f1)
    echo "$WHEELS: $(ls "$WHEELS" | wc -l) wheels, ${kib} KiB"
    if [ "$kib" -gt 65536 ]; then echo "over 64 MiB: too big to travel with the checkout" >&2; exit 1; fi
    ;;
run)
    OUT=${2:?usage: gpu_torch_check.sh run OUT_FOLDER}
    PY=${PYTHON:-python}
    missing=""
    for p in $PKGS; do
        "$PY" -c "import ${p%%:*}" 2>/dev/null || missing="$missing ${p#*:}"
    done
    if [ -n "$missing" ]; then
        echo "installing into .gpu-site:$missing"
        # shellcheck disable=SC2086
        "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" \
            --target .gpu-site $missing
    fi
    PYTHONPATH=".:.gpu-site${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/gpu/torch_check.py --out "$OUT"
    ;;
*)
    echo "usage: $0 wheels | run OUT_FOLDER" >&2
    exit 2
    ;;
esac
