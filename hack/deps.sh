#!/usr/bin/env bash
# Installs what the build and tests need, idempotently. Safe to run on every `make` call: it only
# acts when something is missing.
set -euo pipefail

need_apt=()
command -v cc >/dev/null || need_apt+=(gcc)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
if ((${#need_apt[@]})); then
  echo "hack/deps.sh: installing ${need_apt[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The toolchain is pinned in rust-toolchain.toml; make sure its components are there.
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add rustfmt clippy
fi
