# Sourced by the scripts that build the tests' Go programs from their own modules
# (hack/build-gitops-tools.sh, build-grafana-tools.sh, build-otel-collector.sh). The caller
# sets TOOLSET (its name in logs and errors), SOURCES (tools/<toolset>) and BIN (where the
# binaries are cached), and may redefine go_mod_of after sourcing this.
#
# A binary is stamped with its sources: NAME.src beside it holds source_digest's digest,
# so that editing them rebuilds it. tests/harness/gotools.py computes the same digest.

log() { printf '[%s %s] %s\n' "$TOOLSET" "$(date +%H:%M:%S)" "$*"; }
die() { echo "$TOOLSET: $*" >&2; exit "${2:-1}"; }

# source_digest FIND_ARGS...: sha256 over each file that `find FIND_ARGS` lists below
# SOURCES, its path relative to SOURCES, a NUL, then its bytes, in byte order of the paths.
source_digest() {
  local f
  while IFS= read -r f; do
    printf '%s\0' "$f"
    cat "$SOURCES/$f"
  done < <(cd "$SOURCES" && find "$@" | LC_ALL=C sort) | sha256sum | awk '{print $1}'
}

# package_digest NAME: the digest of a tool that is one Go package, SOURCES/NAME/*.go.
package_digest() { source_digest "$1" -maxdepth 1 -type f -name '*.go'; }

# fresh NAME STAMP: the binary is there and was built from what STAMP names.
fresh() { [[ -x "$BIN/$1" && -f "$BIN/$1.src" && "$(cat "$BIN/$1.src")" == "$2" ]]; }

# use_go MIN_VERSION: Go on PATH, never another toolchain downloaded, BIN made.
use_go() {
  [[ -x /usr/local/go/bin/go ]] && export PATH="/usr/local/go/bin:$PATH"
  command -v go >/dev/null || die "Go >= $1 is required"
  # Fail on a Go older than a module asks for, rather than download another toolchain.
  export GOTOOLCHAIN=local CGO_ENABLED=0
  mkdir -p "$BIN"
}

# go_mod_of MODULE VERSION: the path of that release's go.mod in the module cache.
go_mod_of() {
  local json
  json=$(go mod download -json "$1@$2") || { echo "$TOOLSET: $json" >&2; return 1; }
  sed -n 's/.*"GoMod": "\(.*\)".*/\1/p' <<<"$json"
}

# write_wrapper DIR MODULE VERSION: DIR/go.mod requiring MODULE@VERSION, with the go line
# and the replace directives of that release's own go.mod (a dependency's replaces do not
# apply to the module that requires it, so the wrapper copies them).
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
    echo "$TOOLSET: $module@$version replaces a module with a local directory," \
      "which the module proxy cannot serve:" >&2
    grep -E '=>[[:space:]]*\.\.?/' "$gomod" >&2
    exit 1
  fi
  rm -f "$dir/go.mod" "$dir/go.sum"
  {
    echo "module omnipipe.io/tools/$(basename "$dir")"
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

# build_wrapped NAME MODULE VERSION PACKAGE STAMP: builds BIN/NAME in a wrapper module
# (CACHE/src/NAME) that pins MODULE@VERSION, and stamps it. PACKAGE is "." for a tool of
# ours, whose sources SOURCES/NAME/*.go are copied into the wrapper, or the import path of
# a program in MODULE, which a tools.go importing it keeps in the wrapper's go.mod through
# `go mod tidy`.
build_wrapped() {
  local name=$1 module=$2 version=$3 package=$4 stamp=$5 dir="$CACHE/src/$1" start
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
  echo "$stamp" > "$BIN/$name.src"
  log "$name built in $((SECONDS - start))s"
}
