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
# replace directives of that release's own go.mod (it has none today), as
# hack/build-gitops-tools.sh does.
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
for t in "${TOOLS[@]}"; do
  case $t in
    dashcheck) [[ -d "$SOURCES/$t" ]] || { echo "build-grafana-tools: no tool $t in $SOURCES" >&2; exit 2; } ;;
    dashboard-linter) ;;
    *) echo "build-grafana-tools: no tool $t (dashcheck, dashboard-linter)" >&2; exit 2 ;;
  esac
done

log() { printf '[build-grafana-tools %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# dashcheck is one Go package: tools/grafana/dashcheck/*.go. A digest of those files is
# kept beside its binary as dashcheck.src, so that editing them rebuilds it.
# tests/harness/grafana.py computes the same digest: sha256 over each file's path relative
# to tools/grafana, a NUL, then its bytes, in byte order of the paths. dashboard-linter has
# no sources here: its stamp is its version, which is also in the cache's path.
source_digest() {
  local f
  if [[ $1 == dashboard-linter ]]; then
    echo "$DASHBOARD_LINTER_VERSION"
    return
  fi
  while IFS= read -r f; do
    printf '%s\0' "$f"
    cat "$SOURCES/$f"
  done < <(cd "$SOURCES" && find "$1" -maxdepth 1 -type f -name '*.go' | LC_ALL=C sort) | sha256sum | awk '{print $1}'
}

up_to_date() {
  [[ -x "$BIN/$1" && -f "$BIN/$1.src" && "$(cat "$BIN/$1.src")" == "$(source_digest "$1")" ]]
}

stale=()
for t in "${TOOLS[@]}"; do up_to_date "$t" || stale+=("$t"); done
if [[ ${#stale[@]} -eq 0 ]]; then
  echo "grafana tools: cached in $BIN"
  exit 0
fi

[[ -x /usr/local/go/bin/go ]] && export PATH="/usr/local/go/bin:$PATH"
command -v go >/dev/null || { echo "build-grafana-tools: Go >= 1.23 is required" >&2; exit 1; }
# Fail on a Go older than a module asks for, rather than download another toolchain.
export GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$BIN"

# go_mod_of MODULE VERSION: the path of that release's go.mod in the module cache.
# `go mod download` and `go list -m` of a version read its .info as well, which the proxy
# refuses for dashboard-linter's (see DASHBOARD_LINTER_VERSION); `go mod graph` in a scratch
# module that requires it reads .mod files only.
go_mod_of() {
  local module=$1 version=$2 probe escaped
  probe=$(mktemp -d)
  printf 'module omnipipe.io/grafana/probe\n\ngo %s\n\nrequire %s %s\n' \
    "$(go env GOVERSION | sed 's/^go//')" "$module" "$version" > "$probe/go.mod"
  if ! (cd "$probe" && go mod graph >/dev/null); then
    rm -rf "$probe"
    echo "build-grafana-tools: cannot read the go.mod of $module@$version" >&2
    return 1
  fi
  rm -rf "$probe"
  # The module cache spells a capital letter as ! and the letter in lower case.
  escaped=$(sed 's/[A-Z]/!\l&/g' <<<"$module")
  echo "$(go env GOMODCACHE)/cache/download/$escaped/@v/$version.mod"
}

# write_wrapper DIR MODULE VERSION: DIR/go.mod requiring MODULE@VERSION, with the go line
# and the replace directives of that release's own go.mod.
write_wrapper() {
  local dir=$1 module=$2 version=$3 gomod
  mkdir -p "$dir"
  # go mod tidy moves the require line into a block: match either form.
  if [[ -f "$dir/go.mod" ]] && grep -qxF -e "require $module $version" -e "	$module $version" "$dir/go.mod"; then
    return
  fi
  log "$module@$version: resolving its go.mod"
  gomod=$(go_mod_of "$module" "$version")
  if grep -Eq '=>[[:space:]]*\.\.?/' "$gomod"; then
    echo "build-grafana-tools: $module@$version replaces a module with a local directory," \
      "which the module proxy cannot serve:" >&2
    grep -E '=>[[:space:]]*\.\.?/' "$gomod" >&2
    exit 1
  fi
  rm -f "$dir/go.mod" "$dir/go.sum"
  {
    echo "module omnipipe.io/grafana/$(basename "$dir")"
    echo
    grep -m1 '^go ' "$gomod"
    echo
    echo "require $module $version"
    echo
    # Single-line replaces and replace ( ... ) blocks, as written in that go.mod.
    awk '/^replace \(/ { inblock = 1 } inblock || /^replace [^(]/ { print } inblock && /^\)/ { inblock = 0 }' "$gomod"
  } > "$dir/go.mod.tmp"
  mv "$dir/go.mod.tmp" "$dir/go.mod"
}

# build NAME MODULE VERSION PACKAGE: PACKAGE is "." for a tool of ours, whose sources are
# copied into the wrapper, or the import path of a program in MODULE, which a tools.go
# that imports it keeps in the wrapper's go.mod through `go mod tidy`.
build() {
  local name=$1 module=$2 version=$3 package=$4 dir="$CACHE/src/$1" start
  write_wrapper "$dir" "$module" "$version"
  find "$dir" -maxdepth 1 -name '*.go' -delete
  if [[ $package == . ]]; then
    cp "$SOURCES/$name"/*.go "$dir/"
  else
    printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$package" > "$dir/tools.go"
  fi
  start=$SECONDS
  log "$name: go mod tidy (a cold module cache downloads $module@$version and its dependencies)"
  (cd "$dir" && go mod tidy)
  log "$name: building"
  (cd "$dir" && go build -trimpath -ldflags "-s -w" -o "$BIN/$name.tmp" "$package")
  mv "$BIN/$name.tmp" "$BIN/$name"
  source_digest "$name" > "$BIN/$name.src"
  log "$name built in $((SECONDS - start))s"
}

for t in "${stale[@]}"; do
  case $t in
    dashcheck) build dashcheck github.com/grafana/grafana-foundation-sdk/go "$GRAFANA_SDK_VERSION" . ;;
    dashboard-linter)
      build dashboard-linter github.com/grafana/dashboard-linter "$DASHBOARD_LINTER_VERSION" \
        github.com/grafana/dashboard-linter ;;
  esac
done
log "done: $BIN"
