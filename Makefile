# The one runner: CI and developers call the same targets.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: all deps build test fmt-check clippy unit ucx-compat python-test e2e control-plane images node demo demo-down lint-manifests bench crds fmt clean gpu-bundle gpu-check

all: build

deps:
	hack/deps.sh

build: deps
	$(CARGO) build --workspace --all-targets

fmt-check: deps
	$(CARGO) fmt --all -- --check

clippy: deps
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit: deps
	$(CARGO) test --workspace --exclude pdpair-e2e

## make ucx-compat: the agent's tests again on UCX 1.22 (PyPI's libucx-cu12, cached outside the
## tree), the UCX with CUDA memory support, beside Debian's 1.13 that `unit` runs them on.
ucx-compat: deps
	hack/ucx-compat.sh

## make python-test: the vLLM connector (python/): its wheel built and installed into a cached
## vLLM venv, tested against real agents and inside vLLM's own scheduler.
python-test: deps
	hack/python-test.sh

## make e2e: end-to-end tests against a real control plane, then pdpair installed by Helm on a real
## node (kubelet, containerd) with its own image (all built once, cached outside the tree).
e2e: deps
	hack/e2e.sh
	hack/e2e-node.sh

## make control-plane: build (once) the local Kubernetes control plane.
control-plane: deps
	hack/control-plane.sh build

## make test: format check, clippy with warnings denied, unit tests, the connector's tests, end-to-end tests.
test: fmt-check clippy unit lint-manifests ucx-compat python-test e2e

## make images: pdpair's image as an OCI archive, built here without Docker (hack/images.sh).
images: deps
	hack/images.sh

## make node: build what a real node needs (containerd, runc, CNI, kubelet, kube-proxy, pause).
node: deps
	hack/node.sh build

## make demo: the main job: a local control plane and a real node, pdpair's image built and
## loaded, pdpair installed with Helm, the vLLM mismatches refused, a pair of test-engine pods
## admitted and Ready, a transfer between them through the agent pod.
demo: deps
	hack/demo.sh

## make demo-down: stop what `make demo` left running.
demo-down:
	hack/demo-down.sh

## make lint-manifests: check the examples with the rule table, as CI pipelines would.
lint-manifests: deps
	hack/lint-manifests.sh

## make bench: the benchmarks in docs/benchmarks.md.
bench: deps
	hack/bench.sh

## make gpu-bundle: build (here, no CUDA needed) what gpu-check runs, into .gpu/.
gpu-bundle: deps
	hack/gpu-bundle.sh

## make gpu-check: on a machine with an NVIDIA GPU, run the GPU tests and the gpu-check table
## from .gpu/ (built by gpu-bundle; nothing is built there).
gpu-check:
	hack/gpu-check.sh

## make crds: regenerate crds/ and charts/pdpair/crds/ from the types.
crds:
	UPDATE_CRDS=1 $(CARGO) test -p pdpair-operator --test crds

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
