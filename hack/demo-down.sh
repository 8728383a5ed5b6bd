#!/usr/bin/env bash
# make demo-down: stops what `make demo` started and removes its files.
set -uo pipefail
cd "$(dirname "$0")/.."
DEMO=${PDPAIR_DEMO_DIR:-/tmp/pdpair-demo}
[[ -d $DEMO/cluster ]] && hack/node.sh stop "$DEMO/cluster"
rm -rf "$DEMO"
echo "demo stopped"
