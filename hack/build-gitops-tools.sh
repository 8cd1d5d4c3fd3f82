#!/usr/bin/env bash
# Builds the two programs that give a GitOps tool's health verdict on an OmniPipeline with
# that tool's own library, for tests/harness/gitops.py:
#   kstatus        Flux's kstatus (sigs.k8s.io/cli-utils pkg/kstatus/status.Compute)
#   argocd-health  Argo CD's Lua health checks (github.com/argoproj/argo-cd/v3/util/lua,
#                  through gitops-engine's health.GetResourceHealth)
# from tools/gitops/<name>/*.go, through the module proxy, and caches them under
# ~/.cache/omnipipe/gitops/<pinned versions>/bin. A second run with both present and
# built from the same sources is a no-op. Arguments name a subset to build.
#
# Times on 2 cores: cold (empty module and build caches) kstatus 60 s, argocd-health
# 4 min (1.1 GB of modules, 1.2 GB of build cache); a rebuild after editing a tool's
# source, 3 s.
#
# Each program gets a wrapper module that pins the release (hack/lib/go-tools.sh). Argo
# CD's go.mod replaces Kubernetes and other modules; a dependency's replace directives do
# not apply to the module that requires it, so the wrapper copies them.
set -euo pipefail

CLI_UTILS_VERSION="${CLI_UTILS_VERSION:-v0.37.2}"
# v3.2.12 is the newest Argo CD that builds from the module proxy alone: from v3.3 on,
# argo-cd/v3's go.mod replaces gitops-engine with ./gitops-engine, a nested module the
# proxy does not serve (403), and v3.6 wants Go 1.27. util/lua's health path (lua.go,
# oslib_safe.go) is the same in v3.2.12 and v3.5.7 but for gitops-engine's import path.
ARGOCD_VERSION="${ARGOCD_VERSION:-v3.2.12}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SOURCES="$REPO/tools/gitops"
CACHE="${OMNIPIPE_GITOPS_CACHE:-$HOME/.cache/omnipipe/gitops}/cli-utils-${CLI_UTILS_VERSION}_argo-cd-${ARGOCD_VERSION}"
BIN="$CACHE/bin"
TOOLS=(kstatus argocd-health)
if [[ $# -gt 0 ]]; then TOOLS=("$@"); fi
TOOLSET=build-gitops-tools
# shellcheck source=hack/lib/go-tools.sh
source "$REPO/hack/lib/go-tools.sh"
for t in "${TOOLS[@]}"; do
  [[ -d "$SOURCES/$t" ]] || die "no tool $t in $SOURCES" 2
done

stale=()
for t in "${TOOLS[@]}"; do fresh "$t" "$(package_digest "$t")" || stale+=("$t"); done
if [[ ${#stale[@]} -eq 0 ]]; then
  echo "gitops tools: cached in $BIN"
  exit 0
fi

use_go 1.25
for t in "${stale[@]}"; do
  case $t in
    kstatus) build_wrapped kstatus sigs.k8s.io/cli-utils "$CLI_UTILS_VERSION" . "$(package_digest kstatus)" ;;
    argocd-health)
      build_wrapped argocd-health github.com/argoproj/argo-cd/v3 "$ARGOCD_VERSION" . \
        "$(package_digest argocd-health)" ;;
  esac
done
log "done: $BIN"
