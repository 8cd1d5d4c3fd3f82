#!/usr/bin/env bash
# Runs one set-up step and records what it took, for the table at the end of `make test`:
#   timed.sh NAME CMD [ARGS...]
# prints "[setup] NAME: N s" and appends "NAME<TAB>seconds<TAB>ok|failed<TAB>cpu seconds" to
# build/test-report/setup.tsv. The step's own exit code is kept. The CPU seconds (user +
# system, the step and every process it waited for) say how much of a busy machine the
# step needs, which its wall time on a shared machine does not.
set -uo pipefail
name="$1"
shift
report="$(cd "$(dirname "$0")/.." && pwd)/build/test-report"
mkdir -p "$report"
start=$(date +%s.%N)
"$@"
rc=$?
# `times` (a builtin, so in this shell): its second line is the children's user and
# system time, e.g. "1m2.500s 0m3.250s".
times > "$report/.times.$$"
cpu=$(awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, p, "m"); sub("s", "", p[2]); t += p[1] * 60 + p[2] } printf "%.1f", t }' "$report/.times.$$")
rm -f "$report/.times.$$"
seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
status=ok
((rc == 0)) || status="failed (exit $rc)"
printf '%s\t%s\t%s\t%s\n' "$name" "$seconds" "$status" "$cpu" >> "$report/setup.tsv"
printf '[setup] %s: %s s (%s CPU-s), %s\n' "$name" "$seconds" "$cpu" "$status"
exit "$rc"
