#!/usr/bin/env bash
# The demo: check the example PDPairs with the rule table, the way `kubectl apply` will once the
# admission webhook runs. The vLLM cases show what vLLM does today and what pdpair says instead.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build -q -p pdpair-operator
bin=target/debug/pdpair-operator

for f in examples/*.yaml; do
  echo "== $f"
  grep '^#' "$f" | sed 's/^# \{0,1\}/   /'
  set +e
  "$bin" validate "$f"
  rc=$?
  set -e
  echo "   (exit $rc)"
  echo
done

echo "== all examples at once, as JSON (exit code 1: some pairs are rejected)"
set +e
"$bin" validate -o json examples/*.yaml | head -40
set -e
echo "..."
