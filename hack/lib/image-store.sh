# Sourced by hack/buildah and hack/node-images.sh: the project's own image store, in which
# buildah builds and from which skopeo writes the real node's OCI layouts. Sets
# IMAGE_STORE_DRIVER, IMAGE_STORE_ROOT and IMAGE_STORE_RUNROOT.
# The store uses the overlay driver where this kernel mounts overlayfs (as root it does
# here: a cached rebuild of the operator image takes ~5 s), else vfs, which copies the
# whole root filesystem for every layer and container (the same rebuild: ~2.5 min, most
# of it deleting those copies). Each driver has its own store, since one store cannot
# change driver: $OMNIPIPE_IMAGE_STORE-<driver> (default /var/lib/omnipipe/images-<driver>).
# OMNIPIPE_BUILDAH_DRIVER=vfs|overlay forces one.
image_store_base="${OMNIPIPE_IMAGE_STORE:-/var/lib/omnipipe/images}"
IMAGE_STORE_DRIVER="${OMNIPIPE_BUILDAH_DRIVER:-}"
if [[ -z "$IMAGE_STORE_DRIVER" ]]; then
  IMAGE_STORE_DRIVER=vfs
  if buildah --storage-driver overlay --root "$image_store_base-overlay" \
    --runroot /run/omnipipe/images-overlay info >/dev/null 2>&1; then
    IMAGE_STORE_DRIVER=overlay
  fi
fi
IMAGE_STORE_ROOT="$image_store_base-$IMAGE_STORE_DRIVER"
IMAGE_STORE_RUNROOT="/run/omnipipe/images-$IMAGE_STORE_DRIVER"
