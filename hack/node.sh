#!/usr/bin/env bash
# A real Kubernetes node beside hack/control-plane.sh: containerd (CRI) + runc + the CNI bridge +
# the kubelet and kube-proxy built from the same Debian kubernetes 1.20 tree, cgroupfs driver.
#
#   hack/node.sh build       install containerd/runc/CNI, build kubelet + kube-proxy and the pause
#                            image (cached outside the work tree)
#   hack/node.sh start DIR   start a node for the control plane in DIR (started with
#                            PDPAIR_APISERVER_IP=$NODE_IP, which `hack/node.sh up DIR` does), import
#                            the images in $PDPAIR_CACHE/images, label it like a GPU node
#   hack/node.sh up DIR      control plane + node, ready for pods
#   hack/node.sh stop DIR    stop the node (and undo what it set up), then the control plane
#
# There is no GPU here: the Node carries nvidia.com/gpu.present=true only so the agent DaemonSet
# schedules, and says so in the pdpair.dev/gpu-simulated label.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${PDPAIR_CACHE:-/var/cache/pdpair}
K8S_BIN=$CACHE/kubernetes-1.20/bin
IMAGES=$CACHE/images
# A local address pods can route to (on lo: reachable from the bridge, never from outside).
NODE_IP=${PDPAIR_NODE_IP:-10.254.254.1}
POD_CIDR=10.88.0.0/16
BRIDGE=pdpair0
NODE=pdpair-node
PAUSE=localhost/pdpair-pause:1
log() { echo "node: $*" >&2; }

# shellcheck source=hack/lib.sh
source hack/lib.sh

cmd_build() {
  apt_install containerd runc containernetworking-plugins iptables conntrack buildah libc6-dev gcc
  hack/control-plane.sh build
  hack/control-plane.sh build-node
  if [[ ! -s $IMAGES/pdpair-pause.tar ]]; then
    log "building the pause image"
    mkdir -p "$IMAGES"
    local work store ctr
    work=$(mktemp -d)
    gcc -static -O2 -o "$work/pause" hack/pause.c
    store=(--storage-driver vfs --root "$IMAGES/storage" --runroot "$IMAGES/run")
    ctr=$(buildah "${store[@]}" from scratch)
    buildah "${store[@]}" copy "$ctr" "$work/pause" /pause >/dev/null
    buildah "${store[@]}" config --entrypoint '["/pause"]' "$ctr"
    buildah "${store[@]}" commit -q "$ctr" "$PAUSE" >/dev/null
    buildah "${store[@]}" rm "$ctr" >/dev/null
    buildah "${store[@]}" push -q "$PAUSE" "oci-archive:$IMAGES/pdpair-pause.tar:$PAUSE"
    buildah "${store[@]}" rmi -f "$PAUSE" >/dev/null 2>&1 || true
    rm -rf "$work"
  fi
}


cmd_start() {
  local dir=${1:?usage: node.sh start DIR}
  dir=$(cd "$dir" && pwd)
  [[ -f $dir/kubeconfig ]] || { log "no control plane in $dir"; exit 1; }
  local n=$dir/node
  mkdir -p "$n/cni" "$n/logs" "$n/kubelet"
  : > "$n/pids"
  # No `cmd | grep -q` under pipefail here: grep exits at its match, the writer may die of
  # SIGPIPE, and the pipeline then fails although it matched (it failed this script once).
  [[ $(ip addr show dev lo) == *" $NODE_IP/"* ]] || ip addr add "$NODE_IP/32" dev lo
  echo 1 > /proc/sys/net/ipv4/ip_forward
  cat > "$n/cni/10-pdpair.conflist" <<CNI
{"cniVersion": "0.4.0", "name": "pdpair", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$n/cni-ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
CNI
  cat > "$n/containerd.toml" <<TOML
version = 2
root = "$n/containerd/root"
state = "$n/containerd/state"
[grpc]
  address = "$n/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$n/cni"
TOML
  containerd --config "$n/containerd.toml" >"$n/logs/containerd.log" 2>&1 &
  echo "containerd $!" >> "$n/pids"
  local i
  for i in $(seq 1 60); do [[ -S $n/containerd.sock ]] && break; sleep 0.5; done
  local img
  for img in "$IMAGES"/*.tar; do
    [[ $img == */base-bookworm.tar ]] && continue
    ctr --address "$n/containerd.sock" -n k8s.io images import --no-unpack=false "$img" >/dev/null
  done
  local port
  port=$(free_port)
  "$K8S_BIN/kubelet" --kubeconfig "$dir/kubeconfig" --container-runtime=remote \
    --container-runtime-endpoint "unix://$n/containerd.sock" --cgroup-driver cgroupfs --fail-swap-on=false \
    --hostname-override "$NODE" --node-ip "$NODE_IP" --root-dir "$n/kubelet" --cert-dir "$n/kubelet/pki" \
    --address "$NODE_IP" --port "$port" --read-only-port 0 --healthz-port 0 \
    --eviction-hard 'memory.available<100Mi' --image-gc-high-threshold 100 --image-gc-low-threshold 99 \
    --node-labels "nvidia.com/gpu.present=true,pdpair.dev/gpu-simulated=true" \
    >"$n/logs/kubelet.log" 2>&1 &
  echo "kubelet $!" >> "$n/pids"
  "$K8S_BIN/kube-proxy" --kubeconfig "$dir/kubeconfig" --hostname-override "$NODE" --proxy-mode iptables \
    --cluster-cidr "$POD_CIDR" --healthz-bind-address "127.0.0.1:$(free_port)" \
    --metrics-bind-address "127.0.0.1:$(free_port)" \
    --conntrack-max-per-core 0 >"$n/logs/kube-proxy.log" 2>&1 &
  echo "kube-proxy $!" >> "$n/pids"
  export KUBECONFIG=$dir/kubeconfig
  for i in $(seq 1 120); do
    kubectl get node "$NODE" >/dev/null 2>&1 && break
    sleep 0.5
  done
  # The control plane runs without the nodelifecycle controller, which alone lifts this taint.
  kubectl taint node "$NODE" node.kubernetes.io/not-ready:NoSchedule- >/dev/null 2>&1 || true
  kubectl wait --for=condition=Ready "node/$NODE" --timeout=120s >/dev/null \
    || { tail -20 "$n/logs/kubelet.log" >&2; log "the node did not become Ready"; exit 1; }
  kubectl taint node "$NODE" node.kubernetes.io/not-ready:NoSchedule- >/dev/null 2>&1 || true
  log "node $NODE Ready (pods on $POD_CIDR, apiserver at $NODE_IP)"
}

cmd_stop() {
  local dir=${1:?usage: node.sh stop DIR}
  local n=$dir/node
  if [[ -f $n/pids ]]; then
    # Pods first, so their containers and network namespaces go with the kubelet's help.
    if [[ -f $dir/kubeconfig ]]; then
      KUBECONFIG=$dir/kubeconfig kubectl delete pods --all -A --grace-period=0 --force --wait=false >/dev/null 2>&1 || true
    fi
    if [[ -S $n/containerd.sock ]]; then
      local c
      for c in $(ctr --address "$n/containerd.sock" -n k8s.io tasks ls -q 2>/dev/null); do
        ctr --address "$n/containerd.sock" -n k8s.io tasks kill -s KILL "$c" >/dev/null 2>&1 || true
      done
    fi
    local name pid
    while read -r name pid; do
      if [[ -r /proc/$pid/cmdline && $(tr '\0' ' ' < "/proc/$pid/cmdline") == *"$name"* ]]; then
        kill "$pid" 2>/dev/null || true
      fi
    done < <(tac "$n/pids")
    sleep 1
    # The pods' processes and containerd's shims outlive it: end them (every process in the
    # kubelet's cgroups, then the shims of this containerd).
    local procs
    for procs in $(find /sys/fs/cgroup/*/kubepods -name cgroup.procs 2>/dev/null); do
      xargs -r kill -9 < "$procs" 2>/dev/null || true
    done
    pkill -9 -f -- "containerd-shim-runc-v2 .*-address $n/containerd.sock" 2>/dev/null || true
    rm -f "$n/pids"
    log "stopped"
  fi
  # Undo the host changes: mounts, network namespaces, the bridge, kube-proxy's rules, cgroups.
  grep " $n/" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  ip link del "$BRIDGE" 2>/dev/null || true
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '/^cni-/{print $1}'); do ip netns del "$ns" 2>/dev/null || true; done
  [[ $(iptables-save 2>/dev/null) == *KUBE-* ]] && "$K8S_BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
  # (No CNI rule left makes grep fail: with pipefail that must not end the script before the
  # control plane is stopped below, which left a kube-apiserver running after every run.)
  { iptables -t nat -S 2>/dev/null | grep -- "CNI-" || true; } | sed 's/^-A/-D/' | while read -r rule; do
    eval iptables -t nat "$rule" 2>/dev/null || true
  done
  ip addr del "$NODE_IP/32" dev lo 2>/dev/null || true
  local cg
  for cg in /sys/fs/cgroup/*/kubepods; do
    [[ -d $cg ]] && find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  rm -rf "$n"
  hack/control-plane.sh stop "$dir"
}

cmd_up() {
  local dir=${1:?usage: node.sh up DIR}
  cmd_build
  mkdir -p "$dir"
  [[ $(ip addr show dev lo) == *" $NODE_IP/"* ]] || ip addr add "$NODE_IP/32" dev lo
  PDPAIR_APISERVER_IP=$NODE_IP hack/control-plane.sh start "$dir"
  cmd_start "$dir"
}

case "${1:-}" in
  build) cmd_build ;;
  start) shift; cmd_start "$@" ;;
  up) shift; cmd_up "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  *) echo "usage: $0 build | start DIR | up DIR | stop DIR" >&2; exit 2 ;;
esac
