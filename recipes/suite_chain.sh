#!/usr/bin/env bash
# Several parts of suite_gaps.sh one after the other into one results folder, within SECONDS in all: each part gets
# the time left (less a minute: a suite stops before the next unit after its limit); parts with under 90 s left
# are skipped. Arguments after "--" go to every part (e.g. --set static=true).
# usage: suite_chain.sh RESULTS_DIR SECONDS PART [PART ...] [-- suite args...]
set -u
R=$1; S=$2; shift 2
parts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do parts+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
end=$((SECONDS + S))
for p in "${parts[@]}"; do
  left=$((end - SECONDS - 60))
  if [ "$left" -lt 90 ]; then echo "== $p skipped: $left s left"; continue; fi
  echo "== $p: $left s"
  bash "$(dirname "$0")/suite_gaps.sh" "$R" "$p" "$left" "$@"
done
