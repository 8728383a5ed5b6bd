#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (libcuda and libnvrtc on the loader path, UCX's libucp.so.0):
# the GPU tests (ignored everywhere else), `pdpair-agent gpu-check`'s table, then the vLLM
# connector's GPU tests and its paths measured (python/tests, with that machine's torch). Builds nothing:
# the binaries come from hack/gpu-bundle.sh (`make gpu-bundle`) on the build machine. Writes the
# report to $OUT when set. Exits non-zero when a test or a check fails.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=$here
[[ -x $bundle/gpu-tests ]] || bundle=$here/../.gpu
if [[ ! -x $bundle/gpu-tests || ! -x $bundle/pdpair-agent ]]; then
  echo "gpu-check: no bundle: run 'make gpu-bundle' on the build machine and carry .gpu/ here" >&2
  exit 2
fi
# The machine's own library path, for its python3 and torch (libcuda may be found through it).
machine_ld=${LD_LIBRARY_PATH-}
# The bundle's UCX (what CI runs), ahead of the machine's; CUDA's libraries stay the machine's.
if [[ -d $bundle/lib ]]; then
  export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export UCX_MODULE_DIR=$bundle/lib/ucx
fi
# As the chart runs agents: without UCX's memory hooks.
export UCX_MEM_EVENTS=n
ldconfig_p() { /sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null; }
# No cluster here: an agent that saw these would try the API server (and attest engines).
unset KUBERNETES_SERVICE_HOST KUBERNETES_SERVICE_PORT
# NVRTC (the checksum kernel) where the loader cannot find it: the CUDA wheels of the machine's
# torch carry one (cudarc tries libnvrtc.so, .so.13, .so.12, ...).
# grep -c reads it all: -q stopping early made ldconfig die of SIGPIPE, which pipefail reads as
# not found.
if ! ldconfig_p | grep -c 'libnvrtc\.so' >/dev/null; then
  nvrtc=$(LD_LIBRARY_PATH=$machine_ld timeout 30 python3 -c '
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
hits = [p for d in dirs for p in glob.glob(os.path.join(d, "nvidia", "**", "libnvrtc.so*"), recursive=True)]
print(os.path.dirname(sorted(hits)[-1]) if hits else "")' 2>/dev/null)
  for d in "$nvrtc" /usr/local/cuda/lib64; do
    if [[ -n $d && -d $d ]]; then
      export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d
      machine_ld=${machine_ld:+$machine_ld:}$d
    fi
  done
fi
out=${OUT:-$(mktemp -d)}
# At most 8 files come back from the device tool's $OUT: machine.txt, gpu-tests.txt,
# connector.txt, gpu-check.txt, gpu-check.json, ucx-1.22.txt.
(cat "$bundle/VERSION" 2>/dev/null || echo "bundle: no VERSION (built before it was stamped)"
 timeout 20 nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,compute_mode --format=csv,noheader
 timeout 10 ldd "$bundle/pdpair-agent" | grep -E 'libuc|libnuma|not found'
 ldconfig_p | grep -E 'libcuda\.so|libnvrtc\.so' || echo "ldconfig: no libcuda/libnvrtc"
 echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
 LD_LIBRARY_PATH=$machine_ld timeout 30 python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
) 2>&1 | tee "$out/machine.txt"
# Agents start only where their UCX probe can isolate itself (user or mount namespaces); where
# this machine refuses that, they run without it (a hostile peer address could crash an agent:
# there are none here) rather than not at all.
if ! unshare -m -i -n true 2>/dev/null && ! unshare -U -m -i -n true 2>/dev/null; then
  echo "gpu-check: unshare refused here: agents run with PDPAIR_NO_UCX_PROBE" | tee -a "$out/machine.txt"
  export PDPAIR_NO_UCX_PROBE=true
fi
rc=0
# `timeout` ends only its child: agents (and gpu-check's own children) a killed phase started
# would keep their GPU contexts.
reap() {
  local pattern
  for pattern in 'pdpair-agent run' 'pdpair-agent gpu-check'; do
    if command -v pkill >/dev/null; then
      pkill -KILL -f -- "$pattern" 2>/dev/null || true
    else
      local f p
      for f in /proc/[0-9]*/cmdline; do
        if tr '\0' ' ' <"$f" 2>/dev/null | grep -q -- "$pattern"; then
          p=${f#/proc/}
          kill -KILL "${p%/cmdline}" 2>/dev/null || true
        fi
      done
    fi
  done
}
# Each phase's limit keeps the whole script under about 540 s however it goes (the limits add up
# to 30+20+10+30 = 90 before, 120+110+30+110+60 = 430 for the phases, 20 for UCX 1.22; ldconfig,
# unshare and the reaping take seconds), which leaves a device session room to look at the
# reports; a phase that hangs loses its own rows only.
echo "== GPU tests"
PDPAIR_AGENT_BIN=$bundle/pdpair-agent timeout 120 "$bundle/gpu-tests" --ignored --test-threads=1 2>&1 |
  tee "$out/gpu-tests.txt" || rc=1
reap
echo "== gpu-check"
timeout 110 "$bundle/pdpair-agent" gpu-check --mib 1024 --repeat 5 --json-file "$out/gpu-check.json" 2>&1 |
  tee "$out/gpu-check.txt" || rc=1
reap
echo "== the vLLM connector's direct path (python/tests/test_direct.py -m gpu: torch CUDA tensors, real agents)"
if LD_LIBRARY_PATH=$machine_ld timeout 30 python3 -c 'import torch, pytest; assert torch.cuda.is_available()' 2>/dev/null; then
  # The agent with the bundle's libraries; python3 and torch with the machine's own.
  wrap=$(mktemp -d)/pdpair-agent
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s UCX_MODULE_DIR=%s exec %s "$@"\n' "${LD_LIBRARY_PATH:-}" "${UCX_MODULE_DIR:-}" \
    "$bundle/pdpair-agent" >"$wrap"
  chmod +x "$wrap"
  py() {
    (cd "$here/../python/tests" && env -u UCX_MODULE_DIR LD_LIBRARY_PATH="$machine_ld" PYTHONPATH="$here/../python/src" \
       PDPAIR_AGENT_BIN="$wrap" PYTHONUNBUFFERED=1 "$@")
  }
  py timeout 110 python3 -m pytest -q -rs -p no:cacheprovider -m gpu test_direct.py 2>&1 | tee "$out/connector.txt" || rc=1
  reap
  echo "== the connector's paths, measured (python/tests/bench_gpu.py)" | tee -a "$out/connector.txt"
  py timeout 60 python3 bench_gpu.py 5 2>&1 | tee -a "$out/connector.txt" || rc=1
  reap
else
  echo "gpu-check: no python3 with CUDA torch and pytest here: the connector's GPU tests did not run" | tee "$out/connector.txt"
  rc=1
fi
if [[ -x $bundle/ucx-1.22/bin/ucx_info ]]; then
  echo "== UCX 1.22 (agent.ucx.library=1.22): does its CUDA module load here"
  u=$bundle/ucx-1.22/lib
  # The machine's own path after it: libcuda may be found only through it.
  u_ld=$u${machine_ld:+:$machine_ld}
  (LD_LIBRARY_PATH=$u_ld UCX_MODULE_DIR=$u/ucx timeout 10 "$bundle/ucx-1.22/bin/ucx_info" -v
   LD_LIBRARY_PATH=$u_ld UCX_MODULE_DIR=$u/ucx timeout 10 "$bundle/ucx-1.22/bin/ucx_info" -d |
     grep -E 'Memory domain|Component|Transport|memory types|Device') 2>&1 | tee "$out/ucx-1.22.txt"
fi
echo "gpu-check: exit $rc; reports in $out"
exit $rc
