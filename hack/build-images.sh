#!/usr/bin/env bash
# Builds the Dockerfile's images with buildah, no Docker engine or registry needed:
#   build-images.sh [operator] [router] [worker]     (default: operator router)
# and prints each image's size and build time. The base is the local Debian image from
# hack/debian-base.sh unless PYTHON_IMAGE names another; the worker builds on the
# Dockerfile's vllm-cpu stage (vLLM's CPU build) unless VLLM_IMAGE names another.
# Layers are cached (--layers): a rebuild after a source change re-runs only the steps
# after `COPY omnipipe`. Images are tagged $OMNIPIPE_IMAGE_REPO/<target>:$OMNIPIPE_IMAGE_TAG
# (default localhost/omnipipe/<target>:dev).
# pip inside the build trusts the CA bundle this machine's pip uses (PIP_CERT,
# REQUESTS_CA_BUNDLE or SSL_CERT_FILE), given as the build secret pip-ca: it is mounted
# only while pip runs and is in no layer.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="${OMNIPIPE_IMAGE_REPO:-localhost/omnipipe}"
TAG="${OMNIPIPE_IMAGE_TAG:-dev}"
BUILDAH=(hack/buildah)
targets=("$@")
((${#targets[@]})) || targets=(operator router)
log() { printf '[build-images %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

command -v buildah >/dev/null || { echo "build-images: buildah is required (make system-deps)" >&2; exit 1; }
base="${PYTHON_IMAGE:-}"
if [[ -z "$base" ]]; then
  base=$(bash hack/debian-base.sh)
fi
args=(--build-arg "PYTHON_IMAGE=$base" --build-arg "VLLM_IMAGE=${VLLM_IMAGE:-vllm-cpu}")
for ca in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}"; do
  if [[ -n "$ca" && -s "$ca" ]]; then
    args+=(--secret "id=pip-ca,src=$ca")
    break
  fi
done

for target in "${targets[@]}"; do
  image="$REPO/$target:$TAG"
  log "building $image (base $base)"
  start=$SECONDS
  "${BUILDAH[@]}" bud --isolation chroot --pull-never --layers --network host \
    --target "$target" "${args[@]}" -t "$image" -f Dockerfile . >&2
  size=$("${BUILDAH[@]}" images --format '{{.Size}}' "$image" | awk 'NR == 1')
  log "image $image: $size, built in $((SECONDS - start)) s"
done
