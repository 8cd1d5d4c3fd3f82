#!/usr/bin/env bash
# The images the real-node test tier runs, built from the Dockerfile with buildah
# (hack/build-images.sh) and written as uncompressed OCI image layouts that containerd
# imports (tests/harness/node.py):
#   node-images.sh [target...]      (default: operator router worker)
#   -> ~/.cache/omnipipe/node/images/<target>/  (index.json names localhost/omnipipe/<target>:dev)
# skopeo writes them, not `buildah push`: buildah 1.28 gzips every layer for an oci:
# destination whatever --disable-compression says, so each code change re-read and
# re-compressed the worker's 6.5 GB torch and vLLM layer (2-4 min of both cores, beside
# the unit and e2e tiers). Uncompressed, a layer's blob is named by the digest buildah's
# store already knows, and containers/image skips each blob the layout has: a code change
# writes omnipipe's two small layers, in seconds, and nothing when the image is the one
# already written. Uncompressed also because containerd would only undo the gzip.
# A layout holds one image: the blobs of an older build are deleted once it is written.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib/image-store.sh
source hack/lib/image-store.sh
STORE="containers-storage:[$IMAGE_STORE_DRIVER@$IMAGE_STORE_ROOT+$IMAGE_STORE_RUNROOT]"
OUT="${OMNIPIPE_NODE_STORE:-$HOME/.cache/omnipipe/node}/images"
REPO="${OMNIPIPE_IMAGE_REPO:-localhost/omnipipe}"
TAG="${OMNIPIPE_IMAGE_TAG:-dev}"
targets=("$@")
((${#targets[@]})) || targets=(operator router worker)
log() { printf '[node-images %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

start=$SECONDS
OMNIPIPE_IMAGE_REPO="$REPO" OMNIPIPE_IMAGE_TAG="$TAG" bash hack/build-images.sh "${targets[@]}"
mkdir -p "$OUT"
for target in "${targets[@]}"; do
  image="$REPO/$target:$TAG"
  id=$(hack/buildah images --no-trunc --format '{{.ID}}' "$image" | awk 'NR == 1')
  # The image and the name its layout gives it: one image built under two tags is
  # written again when the other tag asks for it.
  if [[ -f "$OUT/$target.id" && "$(cat "$OUT/$target.id")" == "$id $image" && -s "$OUT/$target/index.json" ]]; then
    log "$image: layout up to date"
    continue
  fi
  s=$SECONDS
  # One image per layout: a layout that named an older build is replaced, its blobs kept
  # until the new image is written (the layers it shares are not written again).
  rm -f "$OUT/$target/index.json" "$OUT/$target.id"
  skopeo copy --quiet --dest-oci-accept-uncompressed-layers "$STORE@${id#sha256:}" \
    "oci:$OUT/$target:$image"
  pruned=$(python3 -m tests.harness.oci_layout prune "$OUT/$target")
  log "$pruned"
  echo "$id $image" > "$OUT/$target.id"
  log "$image: layout written in $((SECONDS - s)) s ($(du -sh "$OUT/$target" | cut -f1))"
done
log "images ready in $((SECONDS - start)) s: $OUT"
