# Shared by the hack/ scripts (sourced): each defines `log` first.

# Installs the Debian packages that are missing.
apt_install() {
  local missing=() p
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# A free TCP port on loopback.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# Writes the benchmarks' PDPair to $1: an 8B-class model (32 layers, 8 KV heads of 128),
# 16-token blocks, push, checksum $2 (default Disabled), dtype $3 (bfloat16), layout $4 (HND).
# A 4096-token prompt is 512 MiB of KV, 64 coalesced writes of 8 MiB per request.
bench_manifest() {
  cat > "$1" <<Y
apiVersion: pdpair.dev/v1alpha1
kind: PDPair
metadata: {name: llama-8b}
spec:
  transfer: {mode: Push, checksum: ${2:-Disabled}, handshakeTimeout: 5s, leaseDuration: 30s}
  prefill:
    kv: &kv {engine: vllm, model: meta-llama/Llama-3.1-8B-Instruct, dtype: ${3:-bfloat16}, layers: 32, kvHeads: 8, headDim: 128, attentionBackend: FLASH_ATTN, layout: ${4:-HND}, blockSize: 16}
  decode:
    kv: *kv
Y
}

# The benchmarks' set-up: a release agent in $bin (absolute) and a temporary directory in $tmp,
# removed on exit with the ucx_perftest server perftest_put left, if one is still running.
bench_setup() {
  cargo build --release -q -p pdpair-agent
  bin="$PWD/target/release/pdpair-agent"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"; if [[ -n ${perftest_server:-} ]]; then kill "$perftest_server" 2>/dev/null || true; fi' EXIT
}

# The ucx_perftest command perftest_put runs (another build: with its environment before it,
# e.g. perftest=(env "LD_LIBRARY_PATH=$L" "$L/../bin/ucx_perftest")).
perftest=(ucx_perftest)

# ucx_perftest's put bandwidth on loopback, the command printed after $5 (a label) and its final
# line: transports $1, message size $2, iterations $3, port $4.
perftest_put() {
  local tls=$1 size=$2 iters=$3 port=$4 label=${5:-}
  UCX_TLS=$tls "${perftest[@]}" -p "$port" >/dev/null 2>&1 &
  perftest_server=$!
  sleep 1
  echo "$label\$ UCX_TLS=$tls ucx_perftest -p $port 127.0.0.1 -t ucp_put_bw -s $size -n $iters"
  UCX_TLS=$tls "${perftest[@]}" -p "$port" 127.0.0.1 -t ucp_put_bw -s "$size" -n "$iters" 2>&1 | grep -E 'Final|^ +[0-9]' | tail -1
  wait "$perftest_server" || true
  perftest_server=
}
