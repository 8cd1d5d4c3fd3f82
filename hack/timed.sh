#!/usr/bin/env bash
# Runs one set-up step and records what it took, for the table at the end of `make test`:
#   timed.sh NAME CMD [ARGS...]
# prints "[setup] NAME: N s" and appends "NAME<TAB>seconds<TAB>ok|failed" to
# build/test-report/setup.tsv. The step's own exit code is kept.
set -uo pipefail
name="$1"
shift
report="$(cd "$(dirname "$0")/.." && pwd)/build/test-report"
mkdir -p "$report"
start=$(date +%s.%N)
"$@"
rc=$?
seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
status=ok
((rc == 0)) || status="failed (exit $rc)"
printf '%s\t%s\t%s\n' "$name" "$seconds" "$status" >> "$report/setup.tsv"
printf '[setup] %s: %s s, %s\n' "$name" "$seconds" "$status"
exit "$rc"
