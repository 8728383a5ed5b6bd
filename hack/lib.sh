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
