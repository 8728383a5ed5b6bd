# The one runner: CI and developers call the same targets.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: all deps build test fmt-check clippy unit demo crds fmt clean

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
	$(CARGO) test --workspace

## make test: format check, clippy with warnings denied, and every test.
test: fmt-check clippy unit

## make demo: run `validate` on the examples and show the verdicts of the vLLM cases.
demo: deps
	hack/demo.sh

## make crds: regenerate crds/ from the types.
crds:
	UPDATE_CRDS=1 $(CARGO) test -p pdpair-operator --test crds

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
