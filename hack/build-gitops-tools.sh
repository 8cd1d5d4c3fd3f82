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
# Each program gets a wrapper module that pins the release. Argo CD's go.mod replaces
# Kubernetes and other modules; a dependency's replace directives do not apply to the
# module that requires it, so the wrapper copies them.
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
for t in "${TOOLS[@]}"; do
  [[ -d "$SOURCES/$t" ]] || { echo "build-gitops-tools: no tool $t in $SOURCES" >&2; exit 2; }
done

log() { printf '[build-gitops-tools %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# A tool is one Go package: tools/gitops/<name>/*.go. A digest of those files is kept
# beside its binary as <name>.src, so that editing them rebuilds it.
# tests/harness/gitops.py computes the same digest: sha256 over each file's path relative
# to tools/gitops, a NUL, then its bytes, in byte order of the paths.
source_digest() {
  local f
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
  echo "gitops tools: cached in $BIN"
  exit 0
fi

[[ -x /usr/local/go/bin/go ]] && export PATH="/usr/local/go/bin:$PATH"
command -v go >/dev/null || { echo "build-gitops-tools: Go >= 1.25 is required" >&2; exit 1; }
# Fail on a Go older than a module asks for, rather than download another toolchain.
export GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$BIN"

# go_mod_of MODULE@VERSION: the path of that release's go.mod in the module cache.
go_mod_of() {
  local json
  json=$(go mod download -json "$1") || { echo "build-gitops-tools: $json" >&2; return 1; }
  sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' <<<"$json"
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
  gomod=$(go_mod_of "$module@$version")
  if grep -Eq '=>[[:space:]]*\.\.?/' "$gomod"; then
    echo "build-gitops-tools: $module@$version replaces a module with a local directory," \
      "which the module proxy cannot serve:" >&2
    grep -E '=>[[:space:]]*\.\.?/' "$gomod" >&2
    exit 1
  fi
  rm -f "$dir/go.mod" "$dir/go.sum"
  {
    echo "module omnipipe.io/gitops/$(basename "$dir")"
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

build() {
  local name=$1 module=$2 version=$3 dir="$CACHE/src/$1" start
  write_wrapper "$dir" "$module" "$version"
  find "$dir" -maxdepth 1 -name '*.go' -delete
  cp "$SOURCES/$name"/*.go "$dir/"
  start=$SECONDS
  log "$name: go mod tidy (a cold module cache downloads $module@$version and its dependencies)"
  (cd "$dir" && go mod tidy)
  log "$name: building"
  (cd "$dir" && go build -trimpath -ldflags "-s -w" -o "$BIN/$name.tmp" .)
  mv "$BIN/$name.tmp" "$BIN/$name"
  source_digest "$name" > "$BIN/$name.src"
  log "$name built in $((SECONDS - start))s"
}

for t in "${stale[@]}"; do
  case $t in
    kstatus) build kstatus sigs.k8s.io/cli-utils "$CLI_UTILS_VERSION" ;;
    argocd-health) build argocd-health github.com/argoproj/argo-cd/v3 "$ARGOCD_VERSION" ;;
  esac
done
log "done: $BIN"
