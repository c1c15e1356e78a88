# accelerate-operator: the commands everyone relies on. `make help` lists them.
# Everything installs what it needs on first use (Go-built control plane, Python venv, helm),
# caching outside the repository in $(CACHE) so the second run is fast.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

CACHE ?= $(or $(ACCELERATE_OPERATOR_CACHE),$(HOME)/.cache/accelerate-operator)
export ACCELERATE_OPERATOR_CACHE := $(CACHE)
PYTEST_ARGS ?=
export PYTEST_ARGS

VENV = $(shell hack/python-env.sh | tail -n1)
PY = $(VENV)/bin/python

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

.PHONY: demo
demo: ## The main job: local cluster + operator, then the CPU example trained to Succeeded
	hack/demo.sh

.PHONY: test
test: ## Everything CI runs, fastest failure first: lint, unit, the cluster built, integration, end-to-end
	hack/test.sh

.PHONY: test-unit
test-unit: ## Unit tests only (seconds, no cluster)
	$(PY) -m pytest tests/unit -p no:cacheprovider $(PYTEST_ARGS)

.PHONY: test-integration
test-integration: ## Integration tests against the real local API server
	$(PY) -m pytest tests/integration -p no:cacheprovider $(PYTEST_ARGS)

.PHONY: test-e2e
test-e2e: ## End-to-end: real training through the operator
	$(PY) -m pytest tests/e2e -p no:cacheprovider $(PYTEST_ARGS)

.PHONY: cluster-up
cluster-up: ## Start (idempotent) the local cluster with the operator; prints the kubeconfig path last
	@hack/cluster-up.sh

.PHONY: cluster-down
cluster-down: ## Stop the local cluster (keeps the built binaries)
	hack/local-cluster.sh down

.PHONY: lint
lint: ## ruff, the layering contracts, the code's shape, helm lint, actionlint, the drift and version checks, the docs site (strict)
	$(PY) -m ruff check operator trainer tests examples bench hack devtools
	$(VENV)/bin/lint-imports
	$(PY) -m devtools.code_shape --check
	$(MAKE) --no-print-directory verify
	$(MAKE) --no-print-directory docs
	tools=$$(hack/install-tools.sh | tail -n1); \
	$$tools/helm lint --strict charts/accelerate-operator; \
	if [[ -x $$tools/actionlint ]]; then $$tools/actionlint; \
	else echo "lint: actionlint skipped (hack/install-tools.sh needs Go to build it)" >&2; fi

.PHONY: manifests
manifests: ## Regenerate the chart's CRD and the CLI's printer columns from crds/, and the docs' reference pages (docs/reference/)
	hack/sync-chart-crd.sh
	$(PY) hack/printer_columns.py
	$(PY) hack/docs_reference.py

.PHONY: verify
verify: ## Fail when generated files drift from their sources, a values key is undocumented, the chart's version differs from pyproject.toml's, or CHANGELOG.md is out of form
	hack/sync-chart-crd.sh --check
	$(PY) hack/printer_columns.py --check
	$(PY) hack/docs_reference.py --check
	hack/check-version.sh >/dev/null
	$(PY) hack/check-changelog.py

.PHONY: docs
docs: ## Build the docs site into site/ in strict mode (a broken link or a page left out fails); offline
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

.PHONY: images
# grep reads all of the status (no -q): under pipefail, a grep that stops at its first match ends
# the status with SIGPIPE, the test fails, and the images were never loaded.
images: ## Build the operator and trainer images, and load them into the local cluster's nodes if it runs
	images=$$(hack/build-images.sh); \
	if hack/local-cluster.sh status | grep '^kubelet@.*running' >/dev/null; then hack/load-images.sh $$images; fi

.PHONY: bench
bench: ## Benchmarks on the local cluster; numbers and ratios go to stdout
	bench/run.sh
