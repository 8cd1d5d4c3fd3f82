#!/usr/bin/env bash
# Builds what a real node adds to the control plane of hack/build-k8s.sh, for the test
# harness's real-node tier (tests/harness/node.py) and cached beside it under
# ~/.cache/omnipipe/k8s/<version>/bin:
#   kubelet, kube-proxy   k8s.io/kubernetes, in build-k8s.sh's wrapper module
#   coredns               a CoreDNS with the plugins a test cluster uses (kubernetes, cache,
#                         errors, health, ready): its own main package, as CoreDNS documents
#                         for builds with fewer plugins; the full set (cloud DNS providers,
#                         etcd, ...) tripled the cold build (6 min on 2 cores)
#   prometheus            Prometheus with Kubernetes service discovery, which Debian's build
#                         leaves out (its other discovery plugins are left out here too:
#                         the remove_all_sd and enable_kubernetes_sd build tags)
#   pause-oci/            the pod sandbox image (a static C pause) as an OCI image layout
#                         for `ctr images import`, named registry.k8s.io/pause:3.10 as the
#                         CRI asks
#   local-path-oci-<v>/   Rancher's local-path-provisioner (kind's default StorageClass),
#                         static, in an image of its own: the claims `weights.source: cache`
#                         makes get hostPath volumes on the node's disk
# A second run with everything present is a no-op. Needs Go, gcc and buildah.
set -euo pipefail
cd "$(dirname "$0")/.."
HACK="$PWD/hack"
K8S_VERSION="${K8S_VERSION:-v1.34.4}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
# Prometheus 3.x; its Go module carries v0.3xx tags.
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
CACHE="${OMNIPIPE_K8S_CACHE:-$HOME/.cache/omnipipe/k8s}/${K8S_VERSION}"
BIN="$CACHE/bin"
PAUSE="$CACHE/pause-oci"
PAUSE_IMAGE="registry.k8s.io/pause:3.10"
LOCAL_PATH_VERSION="${LOCAL_PATH_VERSION:-v0.0.30}"
LOCAL_PATH="$CACHE/local-path-oci-$LOCAL_PATH_VERSION"
LOCAL_PATH_IMAGE="localhost/local-path-provisioner:$LOCAL_PATH_VERSION"
log() { printf '[build-node %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

have_all() {
  for b in kubelet kube-proxy coredns prometheus; do [[ -x "$BIN/$b" ]] || return 1; done
  [[ -s "$PAUSE/index.json" ]] && [[ -s "$LOCAL_PATH/index.json" ]]
}
if have_all; then
  echo "node binaries: cached in $BIN"
  exit 0
fi
[[ -x /usr/local/go/bin/go ]] && export PATH="/usr/local/go/bin:$PATH"
command -v go >/dev/null || { echo "build-node: Go >= 1.24 is required" >&2; exit 1; }
[[ -f "$CACHE/src/go.mod" ]] || bash "$HACK/build-k8s.sh"
export CGO_ENABLED=0
LDFLAGS="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"

for cmd in kubelet kube-proxy; do
  if [[ -x "$BIN/$cmd" ]]; then log "$cmd: cached"; continue; fi
  log "building $cmd (about 2 min with the control plane's build cache warm)"
  start=$SECONDS
  # -mod=mod: the wrapper module was tidied for the control plane; the node's packages
  # add their own sums.
  (cd "$CACHE/src" && GOFLAGS=-mod=mod go build -trimpath -ldflags "$LDFLAGS" \
    -o "$BIN/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd")
  mv "$BIN/$cmd.tmp" "$BIN/$cmd"
  log "$cmd built in $((SECONDS - start)) s"
done

if [[ ! -x "$BIN/coredns" ]]; then
  src="$CACHE/coredns-src"
  mkdir -p "$src"
  cat > "$src/main.go" <<'GO'
// CoreDNS with the plugins the test cluster's Corefile names (tests/harness/node.py).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order in which a server block's plugins run (CoreDNS's plugin.cfg, cut down).
var directives = []string{"bind", "health", "ready", "errors", "cache", "kubernetes"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
GO
  if [[ ! -f "$src/go.mod" ]] || ! grep -q "coredns/coredns $COREDNS_VERSION" "$src/go.mod"; then
    log "resolving CoreDNS $COREDNS_VERSION"
    rm -f "$src/go.mod" "$src/go.sum"
    (cd "$src" && go mod init omnipipe.io/corednsbuild >/dev/null 2>&1 \
      && go get "github.com/coredns/coredns@$COREDNS_VERSION" >/dev/null \
      && go mod tidy)
  fi
  log "building coredns $COREDNS_VERSION (kubernetes, cache, errors, health, ready, bind)"
  start=$SECONDS
  (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$BIN/coredns.tmp" .)
  mv "$BIN/coredns.tmp" "$BIN/coredns"
  log "coredns built in $((SECONDS - start)) s"
fi

if [[ ! -x "$BIN/prometheus" ]]; then
  log "building prometheus $PROMETHEUS_VERSION (Kubernetes service discovery only)"
  start=$SECONDS
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" -tags remove_all_sd,enable_kubernetes_sd \
    "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
  log "prometheus built in $((SECONDS - start)) s"
fi

if [[ ! -s "$PAUSE/index.json" ]]; then
  command -v gcc >/dev/null || { echo "build-node: gcc is required for the pause image" >&2; exit 1; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The sandbox's only job: hold the pod's namespaces and reap nothing; exit on a signal.
  cat > "$work/pause.c" <<'C'
#include <signal.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
int main(void) {
  signal(SIGINT, quit);
  signal(SIGTERM, quit);
  for (;;) pause();
}
C
  gcc -static -Os -o "$work/pause" "$work/pause.c"
  strip "$work/pause"
  ctr=$("$HACK/buildah" from scratch)
  "$HACK/buildah" copy --quiet "$ctr" "$work/pause" /pause >/dev/null
  "$HACK/buildah" config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
  "$HACK/buildah" commit --quiet "$ctr" "$PAUSE_IMAGE" >/dev/null
  "$HACK/buildah" rm "$ctr" >/dev/null
  rm -rf "$PAUSE"
  "$HACK/buildah" push --quiet --disable-compression "$PAUSE_IMAGE" "oci:$PAUSE:$PAUSE_IMAGE"
  log "pause image: $PAUSE"
fi
if [[ ! -s "$LOCAL_PATH/index.json" ]]; then
  log "building local-path-provisioner $LOCAL_PATH_VERSION"
  start=$SECONDS
  lp_work=$(mktemp -d)
  trap 'rm -rf "${work:-}" "$lp_work"' EXIT
  GOBIN="$lp_work" go install -trimpath -ldflags "-s -w" \
    "github.com/rancher/local-path-provisioner@$LOCAL_PATH_VERSION"
  ctr=$("$HACK/buildah" from scratch)
  "$HACK/buildah" copy --quiet "$ctr" "$lp_work/local-path-provisioner" /local-path-provisioner >/dev/null
  "$HACK/buildah" config --entrypoint '["/local-path-provisioner"]' "$ctr"
  "$HACK/buildah" commit --quiet "$ctr" "$LOCAL_PATH_IMAGE" >/dev/null
  "$HACK/buildah" rm "$ctr" >/dev/null
  rm -rf "$LOCAL_PATH"
  "$HACK/buildah" push --quiet --disable-compression "$LOCAL_PATH_IMAGE" \
    "oci:$LOCAL_PATH:$LOCAL_PATH_IMAGE"
  log "local-path-provisioner image: $LOCAL_PATH ($((SECONDS - start)) s)"
fi
log "done: $BIN"
