#!/usr/bin/env bash
# The images the real-node test tier runs, built from the Dockerfile with buildah
# (hack/build-images.sh) and written as uncompressed OCI image layouts that containerd
# imports (tests/harness/node.py):
#   node-images.sh [target...]      (default: operator router worker)
#   -> ~/.cache/omnipipe/node/images/<target>/  (index.json names localhost/omnipipe/<target>:dev)
# A layout keeps the blobs it has, so re-writing it after a source change writes only the
# layers that changed (the worker's torch and vLLM layer is about 6 GB), and nothing when
# the image is the one already written. Uncompressed: gzip of those layers would take
# minutes on 2 cores and containerd would only undo it.
set -euo pipefail
cd "$(dirname "$0")/.."
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
  if [[ -f "$OUT/$target.id" && "$(cat "$OUT/$target.id")" == "$id" && -s "$OUT/$target/index.json" ]]; then
    log "$image: layout up to date"
    continue
  fi
  s=$SECONDS
  # One image per layout: a layout that named an older build is replaced, its blobs kept.
  rm -f "$OUT/$target/index.json" "$OUT/$target.id"
  hack/buildah push --quiet --disable-compression "$image" "oci:$OUT/$target:$image"
  echo "$id" > "$OUT/$target.id"
  log "$image: layout written in $((SECONDS - s)) s ($(du -sh "$OUT/$target" | cut -f1))"
done
log "images ready in $((SECONDS - start)) s: $OUT"
