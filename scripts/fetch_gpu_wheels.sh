#!/usr/bin/env bash
# Download, on a machine with network, the wheels the offline GPU machine lacks into .whl/
# (ignored by git). That machine runs Python 3.12 with torch, triton, transformers, peft,
# tokenizers, numpy, jinja2, prometheus-client and rich already installed; what the project
# needs beyond them is listed below, each pinned to the version this checkout's .venv runs
# (the CPU tests' versions), or the newest when the venv lacks it. Install there with
# `make gpu-install` (pip --no-index, from .whl/ alone).
#
#   scripts/fetch_gpu_wheels.sh            # writes .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
DEST=.whl
# Grammar backends (xgrammar needs apache-tvm-ffi), schema checks, GGUF reading, the HTTP front.
PACKAGES=(
  xgrammar apache-tvm-ffi outlines-core llguidance
  jsonschema jsonschema-specifications referencing rpds-py
  gguf redis
  fastapi starlette opentelemetry-api uvicorn uvloop httptools orjson python-multipart pydantic pydantic-core annotated-types
  typing-inspection typing-extensions
  # The GPU tests' client: the openai SDK (tests/test_tensor_parallel_gpu.py).
  openai jiter distro sniffio httpx2 httpcore2 truststore
)

PLATFORMS=()
for n in 17 24 27 28 31 34 35 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

pinned() {  # NAME==VERSION as installed in $PY's environment, else NAME
  "$PY" - "$1" <<'PYEOF'
import importlib.metadata as m
import sys

name = sys.argv[1]
try:
    print(f"{name}=={m.version(name)}")
except m.PackageNotFoundError:
    print(name)
PYEOF
}

rm -rf "$DEST"
mkdir -p "$DEST"
specs=()
for p in "${PACKAGES[@]}"; do specs+=("$(pinned "$p")"); done
echo "fetching: ${specs[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${specs[@]}"
ls -l "$DEST"
du -sh "$DEST"
