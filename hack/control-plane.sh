#!/usr/bin/env bash
# A real Kubernetes control plane on loopback, without Docker or a kubelet:
# etcd (Debian's etcd-server) + kube-apiserver, kube-controller-manager and kube-scheduler built
# from Debian's `kubernetes` source package (1.20) with Debian's Go.
#
#   hack/control-plane.sh build       build the binaries once, cached outside the work tree
#   hack/control-plane.sh build-node  build the node's kubelet and kube-proxy the same way
#   hack/control-plane.sh start DIR   start everything with data under DIR; writes DIR/kubeconfig
#   hack/control-plane.sh stop DIR    stop exactly the processes `start DIR` started
#
# Ports are chosen free at start time and recorded in DIR/env, so runs never collide with
# leftovers. No kubelet runs: pods stay Pending unless a test marks them, or hack/node.sh starts
# a node. PDPAIR_APISERVER_IP (default 127.0.0.1) is where the apiserver listens and what it
# advertises: hack/node.sh sets a local address that pods can route to.
set -euo pipefail

CACHE=${PDPAIR_CACHE:-/var/cache/pdpair}
K8S_BIN=$CACHE/kubernetes-1.20/bin
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler)
NODE_COMPONENTS=(kubelet kube-proxy)

log() { echo "control-plane: $*" >&2; }

# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"

built() {
  local c
  for c in "$@"; do [[ -x $K8S_BIN/$c ]] || return 1; done
}

cmd_build() {
  apt_install etcd-server openssl curl
  if built "${COMPONENTS[@]}"; then
    log "kubernetes binaries cached in $K8S_BIN"
    return
  fi
  build_from_source "${COMPONENTS[@]}"
}

cmd_build_node() {
  if built "${NODE_COMPONENTS[@]}"; then
    log "kubelet and kube-proxy cached in $K8S_BIN"
    return
  fi
  build_from_source "${NODE_COMPONENTS[@]}"
}

# Builds the named components from Debian's kubernetes source package into $K8S_BIN.
build_from_source() {
  local want=("$@")
  apt_install golang-go golang-github-modern-go-reflect2-dev rsync jq dpkg-dev make
  # deb-src for the same suites as the binary sources.
  local src_list=/etc/apt/sources.list.d/pdpair-deb-src.sources
  if [[ ! -f $src_list ]]; then
    log "enabling deb-src"
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$src_list"
    apt-get update -qq
  fi
  local work=$CACHE/kubernetes-src
  rm -rf "$work" && mkdir -p "$work"
  log "fetching Debian's kubernetes source package (about 30 MB)"
  (cd "$work" && apt-get source -qq kubernetes >/dev/null 2>&1)
  local tree
  tree=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -1)
  [[ -n $tree ]] || { log "apt-get source kubernetes gave no tree"; exit 1; }
  # Kubernetes 1.20 vendors reflect2 1.0.1, which crashes under Go 1.18+ (SIGSEGV in
  # mapiterinit on the first custom resource). Debian's 1.0.2 works.
  rm -rf "$tree/vendor/github.com/modern-go/reflect2"
  cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$tree/vendor/github.com/modern-go/reflect2"
  mkdir -p "$work/gopath/src/k8s.io"
  ln -sfn "$tree" "$work/gopath/src/k8s.io/kubernetes"
  local c
  for c in "${want[@]}"; do
    log "building $c (several minutes on 2 cores)"
    (cd "$work/gopath/src/k8s.io/kubernetes" && GOPATH=$work/gopath GOFLAGS=-mod=vendor GO111MODULE=on \
      make WHAT=cmd/$c >"$work/build-$c.log" 2>&1) || { tail -30 "$work/build-$c.log" >&2; exit 1; }
  done
  mkdir -p "$K8S_BIN"
  for c in "${want[@]}"; do
    cp "$(find "$tree/_output" -type f -name "$c" -perm -u+x | head -1)" "$K8S_BIN/$c"
  done
  rm -rf "$work"
  log "built into $K8S_BIN"
}


cmd_start() {
  local dir=${1:?usage: control-plane.sh start DIR}
  built "${COMPONENTS[@]}" || cmd_build
  command -v etcd >/dev/null || apt_install etcd-server
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  if [[ -f $dir/pids ]]; then
    log "$dir already has a control plane; stopping it first"
    cmd_stop "$dir"
  fi
  mkdir -p "$dir/etcd" "$dir/pki" "$dir/logs"
  local etcd_port etcd_peer api_port cm_port sched_port token
  etcd_port=$(free_port); etcd_peer=$(free_port); api_port=$(free_port); cm_port=$(free_port); sched_port=$(free_port)
  token=$(openssl rand -hex 16)
  local ip=${PDPAIR_APISERVER_IP:-127.0.0.1}
  openssl genrsa -out "$dir/pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$dir/pki/sa.key" -pubout -out "$dir/pki/sa.pub" 2>/dev/null
  echo "$token,admin,admin,system:masters" > "$dir/pki/tokens.csv"
  # The apiserver authenticates to admission webhooks with a client certificate (its
  # WebhookAdmissionConfiguration, for every webhook: user "*"), from a CA that signs nothing
  # else; operators started with --webhook-client-ca pki/webhook-client-ca.crt refuse any caller
  # without it (docs/security.md).
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=pdpair-e2e webhook client CA" \
    -keyout "$dir/pki/webhook-client-ca.key" -out "$dir/pki/webhook-client-ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver-webhook-client" \
    -keyout "$dir/pki/webhook-client.key" -out "$dir/pki/webhook-client.csr" 2>/dev/null
  printf 'extendedKeyUsage=clientAuth\n' > "$dir/pki/webhook-client.ext"
  openssl x509 -req -in "$dir/pki/webhook-client.csr" -CA "$dir/pki/webhook-client-ca.crt" \
    -CAkey "$dir/pki/webhook-client-ca.key" -CAcreateserial -days 2 \
    -extfile "$dir/pki/webhook-client.ext" -out "$dir/pki/webhook-client.crt" 2>/dev/null
  cat > "$dir/pki/webhook-kubeconfig" <<KC
apiVersion: v1
kind: Config
users:
- name: "*"
  user:
    client-certificate: $dir/pki/webhook-client.crt
    client-key: $dir/pki/webhook-client.key
KC
  cat > "$dir/pki/admission.yaml" <<AC
apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
- name: ValidatingAdmissionWebhook
  configuration:
    apiVersion: apiserver.config.k8s.io/v1
    kind: WebhookAdmissionConfiguration
    kubeConfigFile: $dir/pki/webhook-kubeconfig
AC
  : > "$dir/pids"

  etcd --name pdpair --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "pdpair=http://127.0.0.1:$etcd_peer" >"$dir/logs/etcd.log" 2>&1 &
  echo "etcd $!" >> "$dir/pids"

  "$K8S_BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$etcd_port" \
    --secure-port "$api_port" --bind-address "$ip" --advertise-address "$ip" \
    --enable-aggregator-routing=true --kubelet-preferred-address-types InternalIP \
    --cert-dir "$dir/pki/apiserver" --token-auth-file "$dir/pki/tokens.csv" --authorization-mode RBAC \
    --service-account-key-file "$dir/pki/sa.pub" --service-account-signing-key-file "$dir/pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc --service-cluster-ip-range 10.0.0.0/24 \
    --admission-control-config-file "$dir/pki/admission.yaml" \
    >"$dir/logs/kube-apiserver.log" 2>&1 &
  echo "kube-apiserver $!" >> "$dir/pids"

  {
    echo "KUBECONFIG=$dir/kubeconfig"
    echo "APISERVER=https://$ip:$api_port"
    echo "ETCD=http://127.0.0.1:$etcd_port"
  } > "$dir/env"

  local i
  for i in $(seq 1 120); do
    if curl -sfk -H "Authorization: Bearer $token" "https://$ip:$api_port/readyz" >/dev/null 2>&1; then break; fi
    if ! kill -0 "$(awk '$1=="kube-apiserver"{print $2}' "$dir/pids")" 2>/dev/null; then
      tail -20 "$dir/logs/kube-apiserver.log" >&2; cmd_stop "$dir"; log "kube-apiserver exited"; exit 1
    fi
    sleep 0.5
  done
  [[ $i -lt 120 ]] || { tail -20 "$dir/logs/kube-apiserver.log" >&2; cmd_stop "$dir"; log "kube-apiserver not ready after 60 s"; exit 1; }

  # The apiserver's self-signed serving certificate file holds the leaf and its CA: trust the CA.
  awk '/BEGIN CERTIFICATE/{n++} n==2' "$dir/pki/apiserver/apiserver.crt" > "$dir/pki/ca.crt"
  cat > "$dir/kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://$ip:$api_port
    certificate-authority: $dir/pki/ca.crt
users:
- name: admin
  user:
    token: $token
contexts:
- name: local
  context: { cluster: local, user: admin, namespace: default }
current-context: local
KC

  "$K8S_BIN/kube-controller-manager" --kubeconfig "$dir/kubeconfig" --leader-elect=false \
    --port 0 --secure-port "$cm_port" --bind-address 127.0.0.1 \
    --service-account-private-key-file "$dir/pki/sa.key" --use-service-account-credentials=false \
    --root-ca-file "$dir/pki/ca.crt" \
    --controllers='*,-nodeipam,-nodelifecycle,-service,-route,-cloud-node-lifecycle,-attachdetach,-persistentvolume-binder' \
    >"$dir/logs/kube-controller-manager.log" 2>&1 &
  echo "kube-controller-manager $!" >> "$dir/pids"
  "$K8S_BIN/kube-scheduler" --kubeconfig "$dir/kubeconfig" --leader-elect=false \
    --port 0 --secure-port "$sched_port" --bind-address 127.0.0.1 \
    >"$dir/logs/kube-scheduler.log" 2>&1 &
  echo "kube-scheduler $!" >> "$dir/pids"
  log "ready: KUBECONFIG=$dir/kubeconfig (apiserver https://$ip:$api_port)"
}

cmd_stop() {
  local dir=${1:?usage: control-plane.sh stop DIR}
  [[ -f $dir/pids ]] || { log "nothing started in $dir"; return 0; }
  local name pid pids=()
  while read -r name pid; do
    # Only signal a pid that is still the process we started (pids are reused).
    if [[ -r /proc/$pid/cmdline && $(tr '\0' ' ' < "/proc/$pid/cmdline") == *"$name"* ]]; then
      kill "$pid" 2>/dev/null && pids+=("$pid")
    fi
  done < <(tac "$dir/pids")
  local i
  for i in $(seq 1 40); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.25
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -f "$dir/pids"
  log "stopped (${#pids[@]} processes)"
}

case "${1:-}" in
  build) cmd_build ;;
  build-node) cmd_build_node ;;
  start) shift; cmd_start "$@" ;;
  stop) shift; cmd_stop "$@" ;;
  *) echo "usage: $0 build | build-node | start DIR | stop DIR" >&2; exit 2 ;;
esac
