#!/usr/bin/env bash
# Builds otelcol, an OpenTelemetry Collector that receives OTLP and writes what it receives
# as OTLP JSON lines, for tests/harness/otel.py: the collector's own otlpreceiver (core) and
# the contrib fileexporter, assembled by tools/otel/collector/main.go as the collector
# builder (ocb) would. It builds through the module proxy and caches the binary under
# ~/.cache/omnipipe/otel/<pinned versions>/bin. A second run with the binary present and
# built from the same sources is a no-op.
#
# Why this collector and not Jaeger v2 (not tried): Jaeger v2 is a distribution of the same
# collector, with the same otlpreceiver, plus its storage backends, query service and UI,
# so it is a larger build for the same receiving code. Core plus one contrib exporter is
# the smallest build that runs the collector's real OTLP decoding and pipeline. The contrib
# fileexporter builds from the proxy, so it is used as it is rather than an exporter of our
# own: its `format: json` is ptrace.JSONMarshaler, one ExportTraceServiceRequest a line.
#
# Times on 2 cores, at nice 19 beside a clean-clone CI run: cold (empty module and build
# caches) 4 min 30 s (2 min 12 s of CPU; the downloads 10 s), 500 MB of modules and 590 MB
# of build cache, a 36 MB binary; a rebuild after editing main.go, 2 s.
#
# The versions are pinned in tools/otel/collector/go.mod and its go.sum, which are
# committed: `go build -mod=readonly` there needs no `go mod tidy`. To move to a new
# release, change the versions in go.mod and run `go mod tidy -e` in that directory: -e
# because fileexporter's tests import otlpencodingextension, which proxy.golang.org
# refuses (403) at every version; the build itself never imports it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SOURCES="$REPO/tools/otel"
MODULE_DIR="$SOURCES/collector"
# pinned MODULE: its version in the wrapper go.mod.
pinned() { awk -v m="$1" '$1 == m { print $2; exit }' "$MODULE_DIR/go.mod"; }
COLLECTOR_VERSION="$(pinned go.opentelemetry.io/collector/otelcol)"
CONTRIB_VERSION="$(pinned github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter)"
[[ -n "$COLLECTOR_VERSION" && -n "$CONTRIB_VERSION" ]] || {
  echo "build-otel-collector: $MODULE_DIR/go.mod pins no otelcol or fileexporter" >&2; exit 2; }
CACHE="${OMNIPIPE_OTEL_CACHE:-$HOME/.cache/omnipipe/otel}/otelcol-${COLLECTOR_VERSION}_contrib-${CONTRIB_VERSION}"
BIN="$CACHE/bin"
NAME=otelcol

TOOLSET=build-otel-collector
# shellcheck source=hack/lib/go-tools.sh
source "$REPO/hack/lib/go-tools.sh"

# The collector's stamp: the digest of tools/otel/collector's *.go, go.mod and go.sum.
STAMP="$(source_digest collector -maxdepth 1 -type f \( -name '*.go' -o -name go.mod -o -name go.sum \))"
if fresh "$NAME" "$STAMP"; then
  echo "otel collector: cached in $BIN"
  exit 0
fi

use_go 1.26
start=$SECONDS
log "$NAME: downloading otelcol $COLLECTOR_VERSION, fileexporter $CONTRIB_VERSION and their dependencies (a no-op when the module cache has them)"
(cd "$MODULE_DIR" && go mod download)
log "$NAME: building"
(cd "$MODULE_DIR" && go build -mod=readonly -trimpath -ldflags "-s -w" -o "$BIN/$NAME.tmp" .)
mv "$BIN/$NAME.tmp" "$BIN/$NAME"
echo "$STAMP" > "$BIN/$NAME.src"
log "$NAME built in $((SECONDS - start))s"
log "done: $BIN"
