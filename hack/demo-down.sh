#!/usr/bin/env bash
# make demo-down: stops what `make demo` started and removes its files.
set -uo pipefail
cd "$(dirname "$0")/.."
DEMO=${PDPAIR_DEMO_DIR:-/tmp/pdpair-demo}
if [[ -f $DEMO/pids ]]; then
  while read -r name pid; do
    if kill "$pid" 2>/dev/null; then echo "stopped $name (pid $pid)"; fi
  done < "$DEMO/pids"
fi
[[ -d $DEMO/cp ]] && hack/control-plane.sh stop "$DEMO/cp"
rm -rf "$DEMO"
echo "demo stopped"
