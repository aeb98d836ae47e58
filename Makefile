# `make demo` and `make test` set up a fresh machine themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU torch unless a GPU is visible: a bare `torch` requirement would pull a
# multi-GB CUDA build on a machine that cannot use it.
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch
PYTEST_ARGS ?=
SOAK_MINUTES ?= 30
SOAK_HOGS ?= 2

.PHONY: setup cluster-deps check demo test test-fast docs soak bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q "$(TORCH_GPU)"; \
	else \
		$(PIP) install -q "$(TORCH_CPU)"; \
	fi
	$(PIP) install -q -e '.[test]'
	touch $@

demo: setup
	$(VENV)/bin/megaresil train recipes/gpt-tiny.yaml run.dir=runs/demo

# The linter and the type checker over megaresil/ (their settings: pyproject.toml),
# before the tests, so a lint error fails in seconds rather than after the suite.
check: setup
	$(PY) -m ruff check megaresil
	$(PY) -m mypy

test: setup cluster-deps check
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

# The test_slurm_* tests run a real one-host Slurm cluster, the test_etcd_*
# tests a real etcd server, test_netns_hosts nodes in namespaces (iproute2's
# `ip`). As root on a machine with apt (CI, a fresh VM) their Debian packages
# are installed here; elsewhere those tests skip and say why.
CLUSTER_PKGS ?= slurmctld slurmd slurm-client munge etcd-server iproute2
cluster-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		! { command -v slurmctld && command -v etcd && command -v ip; } >/dev/null; then \
		echo "installing $(CLUSTER_PKGS) for the cluster tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			$(CLUSTER_PKGS) >/dev/null; \
	fi

# Faults of every kind for SOAK_MINUTES at 3D with CPU hogs, then a reference.
soak: setup
	$(VENV)/bin/megaresil soak recipes/gpt-tiny.yaml --minutes $(SOAK_MINUTES) \
		--hogs $(SOAK_HOGS) run.dir=runs/soak

# The manual as a site under build/site (mkdocs --strict: a broken link fails).
docs: setup
	$(PY) tools/docs_site.py

test-fast: setup check
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache runs
