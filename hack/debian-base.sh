#!/usr/bin/env bash
# Makes the local base image the Dockerfile builds FROM where no registry can be reached:
# Debian bookworm (minbase) with python3, python3-venv and ca-certificates, the same
# Debian release and Python (3.11) as the public python:3.11-slim-bookworm base.
#   debian-base.sh            -> prints the image name, localhost/omnipipe-base:bookworm-py3
# The root filesystem is made once with mmdebstrap (about 1 min) and cached as a tarball
# under ~/.cache/omnipipe/images/, like the Kubernetes binaries; the image is committed
# from it with `buildah from scratch` + mount + untar (buildah has no `import`). A second
# run with the image present is a no-op.
set -euo pipefail
SUITE="${DEBIAN_SUITE:-bookworm}"
PACKAGES="python3,python3-venv,ca-certificates"
IMAGE="localhost/omnipipe-base:${SUITE}-py3"
CACHE="${OMNIPIPE_IMAGE_CACHE:-$HOME/.cache/omnipipe/images}"
# The tarball's name carries what went into it, so a changed package list remakes it.
KEY=$(printf '%s %s' "$SUITE" "$PACKAGES" | sha1sum | cut -c1-10)
ROOTFS="$CACHE/debian-$SUITE-$KEY.tar"
BUILDAH=("$(dirname "$0")/buildah")
log() { printf '[debian-base %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if "${BUILDAH[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1; then
  echo "$IMAGE"
  exit 0
fi
mkdir -p "$CACHE"
if [[ ! -s "$ROOTFS" ]]; then
  log "mmdebstrap $SUITE minbase + $PACKAGES -> $ROOTFS (about 1 min)"
  # Docs, man pages and locales are dropped as python:slim drops them; licences stay.
  mmdebstrap --variant=minbase --format=tar --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    "$SUITE" "$ROOTFS.tmp" >&2
  mv "$ROOTFS.tmp" "$ROOTFS"
fi
log "committing $ROOTFS as $IMAGE"
ctr=$("${BUILDAH[@]}" from scratch)
trap '"${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
mnt=$("${BUILDAH[@]}" mount "$ctr")
tar -xf "$ROOTFS" -C "$mnt" --numeric-owner
"${BUILDAH[@]}" umount "$ctr" >/dev/null
"${BUILDAH[@]}" config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --label org.opencontainers.image.description="Debian $SUITE minbase + $PACKAGES (mmdebstrap)" "$ctr"
"${BUILDAH[@]}" commit --quiet "$ctr" "$IMAGE" >/dev/null
echo "$IMAGE"
