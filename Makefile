# The two commands of the README: `make demo` (the main job) and `make test`.
# Both install what is missing (apt packages, the virtualenv, pip packages) and skip the rest.

VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTHON  ?= python3
SUDO    := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
APT_PKGS := fuse3 libfuse3-dev pkg-config gcc systemd attr etcd-server etcd-client debootstrap \
	systemd-container dnsmasq-base squashfuse squashfs-tools faketime iproute2 \
	podman runc busybox-static librsvg2-bin
CHECKED := kspeedfs mountd pytorch_ext tests bench

.PHONY: demo test quick lint deps apt bench clean

demo: deps
	$(BIN)/kspeedfs demo

# The tests start hundreds of Python processes (nodes, mounts, CLI calls): with bytecode caching
# off (PYTHONDONTWRITEBYTECODE, set in some images) each compiles every module it imports, and
# pytest rewrites every test module again. 87 s -> 70 s for `make quick` on 2 CPUs.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest
# Both run spread over the cores (pytest-xdist; each test has its own ports, folders, network
# namespace and health table; the few that change a switch of the machine hold a lock): twice
# the CPUs, at most 8, since a test mostly waits on the processes it started (docs/testing.md).
WORKERS := $(shell $(PYTHON) -c 'import os; print(min(8, 2 * len(os.sched_getaffinity(0))))')

test: deps lint
	$(PYTEST) -q -n $(WORKERS)

# The quick loop while changing code: no multi-node, etcd, nspawn, DALI or 1M-line tests. Its
# tests mostly compute rather than wait, and each worker imports every test module (torch
# among them, ~6 CPU-s): one worker more than the CPUs, not twice (2 CPUs: 3 workers, 35-47 s
# in most runs; 4 workers, 46-71 s, docs/testing.md).
QUICK_WORKERS := $(shell $(PYTHON) -c 'import os; print(min(8, len(os.sched_getaffinity(0)) + 1))')

quick: deps
	$(PYTEST) -q -m "not slow" -n $(QUICK_WORKERS)

lint: deps
	$(BIN)/ruff check $(CHECKED)
	$(BIN)/ruff format --check $(CHECKED)
	$(BIN)/mypy kspeedfs mountd pytorch_ext
	$(BIN)/lint-imports

bench: deps
	$(BIN)/python bench/bench_fuse.py

deps: apt $(STAMP)

apt:
	@missing=""; \
	for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || missing="$$missing python3-venv"; \
	$(PYTHON) -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
		|| missing="$$missing python3-dev"; \
	if [ -n "$$missing" ]; then \
		echo "installing apt packages:$$missing"; \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; \
	fi

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e '.[torch,dev,s3,dali,stacks,kubernetes]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info

# Optional RDMA transport: Debian's pyverbs (built for Python 3.11) linked into the virtualenv.
RDMA_APT := rdma-core ibverbs-providers python3-pyverbs
DEB_PYVERBS := /usr/lib/python3/dist-packages/pyverbs

.PHONY: rdma
rdma: deps
	@missing=""; \
	for p in $(RDMA_APT); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing apt packages:$$missing"; \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; \
	fi
	ln -sfn $(DEB_PYVERBS) "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/pyverbs"
	@$(BIN)/python -c 'import pyverbs.device' || { \
		echo "pyverbs does not import: Debian's is built for $$(ls $(DEB_PYVERBS)/device.*.so)"; exit 1; }
	@$(BIN)/python -c 'from kspeedfs.rdma.verbs import probe; p = probe(); \
		print("RDMA:", f"usable ({p.device} port {p.port})" if p.usable else f"not usable here: {p.reason}")'
