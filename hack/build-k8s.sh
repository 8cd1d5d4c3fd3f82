#!/usr/bin/env bash
# Builds the Kubernetes control-plane binaries the test harness runs (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl) plus kwok and helm, from the official
# Go modules through the module proxy, and caches them under
# ~/.cache/omnipipe/k8s/<version>/bin. A second run with everything present is a no-op.
#
# k8s.io/kubernetes cannot be `go install`ed directly: its go.mod replaces ~30 staging
# modules with ./staging paths. A small wrapper module pins the same release and maps each
# staging module to its published v0.Y.Z tag instead.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
KWOK_VERSION="${KWOK_VERSION:-v0.7.0}"
# kwok v0.7.0 is the version the test harness is proven with (etcd 3.4 from Debian).
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CACHE="${OMNIPIPE_K8S_CACHE:-$HOME/.cache/omnipipe/k8s}/${K8S_VERSION}"
BIN="$CACHE/bin"
STAGING_TAG="v0.${K8S_VERSION#v1.}"
WANT=(kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)

STAGES="$CACHE/kwok-stages.yaml"

have_all() {
  for b in "${WANT[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
  [[ -s "$STAGES" ]]
}
if have_all; then
  echo "k8s binaries: cached in $BIN"
  exit 0
fi
[[ -x /usr/local/go/bin/go ]] && export PATH="/usr/local/go/bin:$PATH"
command -v go >/dev/null || { echo "build-k8s: Go >= 1.24 is required to build Kubernetes" >&2; exit 1; }

mkdir -p "$BIN" "$CACHE/src"
cd "$CACHE/src"
log() { printf '[build-k8s %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ ! -f go.mod ]] || ! grep -q "k8s.io/kubernetes $K8S_VERSION" go.mod; then
  log "resolving k8s.io/kubernetes@$K8S_VERSION staging modules -> $STAGING_TAG"
  gomod=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  mapfile -t staging < <(sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\1#p' "$gomod")
  go_line=$(grep -m1 '^go ' "$gomod")
  {
    echo "module omnipipe.io/k8sbuild"
    echo
    echo "$go_line"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    for m in "${staging[@]}"; do echo "	$m => $m $STAGING_TAG"; done
    echo ")"
  } > go.mod
  cat > tools.go <<'GO'
//go:build tools

package k8sbuild

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  log "${#staging[@]} staging modules pinned; go mod tidy (downloads modules)"
  GOFLAGS=-mod=mod go mod tidy -e 2>&1 | tail -5 || true
fi

export CGO_ENABLED=0
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  if [[ -x "$BIN/$cmd" ]]; then log "$cmd: cached"; continue; fi
  log "building $cmd (a cold build of all three servers takes ~10 min on 2 cores)"
  start=$SECONDS
  go build -tags tools -trimpath -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION" \
    -o "$BIN/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd"
  mv "$BIN/$cmd.tmp" "$BIN/$cmd"
  log "$cmd built in $((SECONDS - start))s"
done

for spec in "kwok sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "helm helm.sh/helm/v3/cmd/helm@$HELM_VERSION"; do
  read -r name pkg <<<"$spec"
  if [[ -x "$BIN/$name" ]]; then log "$name: cached"; continue; fi
  log "go install $pkg"
  GOBIN="$BIN" go install -trimpath -ldflags "-s -w" "$pkg"
done
# kwok needs stage definitions to move nodes to Ready and pods to Running; the
# "fast" set ships inside the kwok module we just built from.
if [[ ! -s "$STAGES" ]]; then
  kwok_src="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
  for f in "$kwok_src"/node/fast/node-initialize.yaml "$kwok_src"/pod/fast/pod-*.yaml; do
    echo "---"; cat "$f"
  done > "$STAGES.tmp"
  mv "$STAGES.tmp" "$STAGES"
  log "kwok stages written to $STAGES"
fi
log "done: $BIN"
