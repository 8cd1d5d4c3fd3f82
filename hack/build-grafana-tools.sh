#!/usr/bin/env bash
# Builds the two programs that check the chart's Grafana dashboards without a Grafana
# server, for tests/harness/grafana.py:
#   dashcheck         strict decoding and Validate() of the Grafana Foundation SDK
#                     (github.com/grafana/grafana-foundation-sdk/go dashboard), from
#                     tools/grafana/dashcheck/*.go
#   dashboard-linter  Grafana's dashboard linter (github.com/grafana/dashboard-linter),
#                     built from its own module, unchanged
# through the module proxy, and caches them under ~/.cache/omnipipe/grafana/<pinned
# versions>/bin. A second run with both present and dashcheck built from the same sources
# is a no-op. Arguments name a subset to build.
#
# Times on 2 cores, cold (empty module and build caches): dashcheck 28 s (24 MB of modules,
# 130 MB of build cache), dashboard-linter 2 min 15 s (1.5 GB of modules, Prometheus' and
# Loki's among them; 630 MB more of build cache); beside a CI run that kept both cores
# busy, 77 s and 5.5 min. A rebuild after editing dashcheck's source, 1 to 2 s.
#
# Each program gets a wrapper module that pins the release, with the go line and the
# replace directives of that release's own go.mod (it has none today): hack/lib/go-tools.sh.
set -euo pipefail

# v0.0.22 is the newest release of the SDK's Go module (proxy.golang.org's @v/list).
GRAFANA_SDK_VERSION="${GRAFANA_SDK_VERSION:-v0.0.22}"
# The linter has no releases. Its newest commits (go.mod `go 1.26.3`) replace
# hashicorp/memberlist, so `go install ...@latest` refuses them; the last commit of
# April 2025, the merge of #237, has no replace directive and builds. It is not installed
# with `go install module@version`: that asks the proxy for the version's .info, which
# proxy.golang.org answers here with 403 "This module version is not available" (as it
# does @v/list and @latest), while it serves the version's .mod and .zip, all that a
# wrapper module requiring the exact pseudo-version needs.
DASHBOARD_LINTER_VERSION="${DASHBOARD_LINTER_VERSION:-v0.0.0-20250428211052-5e22d6dc65a1}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SOURCES="$REPO/tools/grafana"
CACHE="${OMNIPIPE_GRAFANA_CACHE:-$HOME/.cache/omnipipe/grafana}/sdk-${GRAFANA_SDK_VERSION}_dashboard-linter-${DASHBOARD_LINTER_VERSION}"
BIN="$CACHE/bin"
TOOLS=(dashcheck dashboard-linter)
if [[ $# -gt 0 ]]; then TOOLS=("$@"); fi
TOOLSET=build-grafana-tools
# shellcheck source=hack/lib/go-tools.sh
source "$REPO/hack/lib/go-tools.sh"
for t in "${TOOLS[@]}"; do
  case $t in
    dashcheck) [[ -d "$SOURCES/$t" ]] || die "no tool $t in $SOURCES" 2 ;;
    dashboard-linter) ;;
    *) die "no tool $t (dashcheck, dashboard-linter)" 2 ;;
  esac
done

# dashcheck's stamp is its sources' digest; dashboard-linter has no sources here: its stamp
# is its version, which is also in the cache's path.
stamp() {
  if [[ $1 == dashboard-linter ]]; then echo "$DASHBOARD_LINTER_VERSION"; else package_digest "$1"; fi
}

stale=()
for t in "${TOOLS[@]}"; do fresh "$t" "$(stamp "$t")" || stale+=("$t"); done
if [[ ${#stale[@]} -eq 0 ]]; then
  echo "grafana tools: cached in $BIN"
  exit 0
fi

use_go 1.23

# go_mod_of MODULE VERSION, redefined: `go mod download` and `go list -m` of a version read
# its .info as well, which the proxy refuses for dashboard-linter's (see
# DASHBOARD_LINTER_VERSION); `go mod graph` in a scratch module that requires it reads .mod
# files only.
go_mod_of() {
  local module=$1 version=$2 probe escaped
  probe=$(mktemp -d)
  printf 'module omnipipe.io/grafana/probe\n\ngo %s\n\nrequire %s %s\n' \
    "$(go env GOVERSION | sed 's/^go//')" "$module" "$version" > "$probe/go.mod"
  if ! (cd "$probe" && go mod graph >/dev/null); then
    rm -rf "$probe"
    echo "$TOOLSET: cannot read the go.mod of $module@$version" >&2
    return 1
  fi
  rm -rf "$probe"
  # The module cache spells a capital letter as ! and the letter in lower case.
  escaped=$(sed 's/[A-Z]/!\l&/g' <<<"$module")
  echo "$(go env GOMODCACHE)/cache/download/$escaped/@v/$version.mod"
}

for t in "${stale[@]}"; do
  case $t in
    dashcheck)
      build_wrapped dashcheck github.com/grafana/grafana-foundation-sdk/go "$GRAFANA_SDK_VERSION" . \
        "$(stamp dashcheck)" ;;
    dashboard-linter)
      build_wrapped dashboard-linter github.com/grafana/dashboard-linter "$DASHBOARD_LINTER_VERSION" \
        github.com/grafana/dashboard-linter "$(stamp dashboard-linter)" ;;
  esac
done
log "done: $BIN"
