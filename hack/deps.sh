#!/usr/bin/env bash
# Installs what the build and tests need, idempotently. Safe to run on every `make` call: it only
# acts when something is missing.
set -euo pipefail

need_apt=()
command -v cc >/dev/null || need_apt+=(gcc)
command -v c++ >/dev/null || need_apt+=(g++)
command -v pkg-config >/dev/null || need_apt+=(pkg-config)
command -v curl >/dev/null || need_apt+=(curl)
command -v openssl >/dev/null || need_apt+=(openssl)
command -v python3 >/dev/null || need_apt+=(python3)
# UCX for the agent's transfers (headers and libraries; ucx_perftest for the benchmarks).
dpkg-query -W -f='${Status}' libucx-dev 2>/dev/null | grep -q "ok installed" || need_apt+=(libucx-dev)
command -v ucx_perftest >/dev/null || need_apt+=(ucx-utils)
if ((${#need_apt[@]})); then
  echo "hack/deps.sh: installing ${need_apt[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# The toolchain is pinned in rust-toolchain.toml; make sure its components are there.
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
  rustup component add rustfmt clippy
fi

# kubectl drives the end-to-end tests the way a user would. The machine image ships it; Debian
# does not package it, so say so plainly instead of failing later.
if ! command -v kubectl >/dev/null; then
  echo "hack/deps.sh: kubectl is missing; install it (the machine image normally has it)" >&2
  exit 1
fi
