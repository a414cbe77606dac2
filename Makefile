# hostpool: the two commands a new user needs are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# hostpool never requires torch (an engine brings its own). The tests and benches do: the
# CPU wheel is pinned and installed first, so nothing can pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
SERVE_ARGS ?=
# torch's inductor (vLLM imports it) makes <tmp>/torchinductor_<user> on import: keep it
# in the checkout, so neither a test run nor a bench leaves it in /tmp.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/torchinductor

.PHONY: run test test-fast lint dist docs bench soak dashboards prometheus kubectl sglang-libs vllm-venv clean

SERVE_STAMP := $(VENV)/.serve-stamp

# What `hostpool serve` needs, and nothing else: hostpool with its runtime dependencies,
# no torch (venv's own pip builds an editable install; upgrading it costs seconds).
$(SERVE_STAMP): pyproject.toml setup.py build_support/editable_pth.py hostpool-instrument.pth hostpool/proc/bulkread.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $(SERVE_STAMP)

# Everything the tests, lint and benchmarks need, on top of the serve install: the pinned
# CPU torch first, then the extras. Not a file prerequisite of the serve install: a venv
# installed whole before the split stays up to date.
$(STAMP): pyproject.toml setup.py build_support/editable_pth.py hostpool-instrument.pth requirements/sglang-test.txt hostpool/proc/bulkread.c
	$(MAKE) --no-print-directory $(SERVE_STAMP)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c <(echo "$(TORCH_SPEC)") -e ".[dev,bench,torch]"
	# The real sglang for tests/sglang: a pinned closure without sglang's GPU dependencies.
	$(PY) -m pip install -q --no-deps -c <(echo "$(TORCH_SPEC)") -r requirements/sglang-test.txt
	touch $(STAMP)

# The real vLLM for tests/vllm (~3.5 GB, ~2.5 min): its own venv, CPU torch pinned, hostpool
# editable (it follows the working tree) with its runtime dependencies, vLLM's pins frozen.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): requirements/vllm-test.txt pyproject.toml setup.py build_support/editable_pth.py hostpool-instrument.pth
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q -c <(echo "$(TORCH_SPEC)") -r requirements/vllm-test.txt
	# torchvision's wheels link libtorch_cuda: with them `import vllm` fails on CPU torch.
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip freeze --exclude-editable > $(VLLM_VENV)/frozen.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/frozen.txt $$($(VLLM_PY) -c \
	  'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
	$(VLLM_PY) -c 'import vllm, hostpool.integrations.vllm'
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# libibverbs, which the real mooncake allocator (sglang's foreign-allocator tests) links.
sglang-libs:
	@test -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 || ldconfig -p | grep -q 'libibverbs\.so\.1 ' || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; }

# promtool and prometheus (Debian's package, 2.42) for the rules and end-to-end tests.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# kubectl, whose kustomize (v5: kubectl 1.27 or later) renders deploy/kubernetes for
# tests/test_kubernetes*.py: the apt package `kubectl`, else Debian's kubernetes-client.
kubectl:
	@command -v kubectl >/dev/null || { apt-get update -qq && { \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kubectl >/dev/null || \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null; }; }

# A venv already installed whole serves as it is; a fresh one gets only the serve install.
run: $(if $(wildcard $(STAMP)),$(STAMP),$(SERVE_STAMP))
	exec $(VENV)/bin/hostpool serve $(SERVE_ARGS)

# The sdist and the wheel in dist/ (the wheel built from the sdist, as `python -m build`
# does), their metadata checked; what the Containerfile installs.
dist: $(STAMP)
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

# HOSTPOOL_LEFTOVER_CHECK=1: the run fails if it left anything in /tmp, /dev/shm or
# nr_hugepages (tests/conftest.py; other runs only report it).
test: $(STAMP) $(VLLM_STAMP) prometheus kubectl sglang-libs
	HOSTPOOL_LEFTOVER_CHECK=1 $(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP) sglang-libs
	$(PY) -m pytest -x -q -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check hostpool tests bench dashboards tools
	$(VENV)/bin/ruff format --check hostpool tests bench dashboards tools
	$(VENV)/bin/mypy
	# No module uses another's private names (ruff's PLC2701 skips imports within a package).
	$(PY) tools/check_private_names.py hostpool
	# The C extension compiles without a warning (pip builds it without -Werror).
	gcc -fsyntax-only -Wall -Wextra -Werror -I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" hostpool/proc/bulkread.c
	# The docs build with every link and anchor resolved (mkdocs.yml: strict, validation;
	# not --quiet, which drops the warnings --strict counts and so passes anything).
	d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && $(VENV)/bin/mkdocs build --strict --site-dir "$$d/site"

# The documentation site (docs/, nav in mkdocs.yml) on http://127.0.0.1:8000.
docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

# The other page states compare the targets' variants only (restated peers: warm table).
POPULATE_STATES = hostpool_shm,hostpool_shm_2mb,hostpool_mmap,sglang_alloc_shm,sglang_alloc_mmap_2mb,sglang_alloc_mmap_parallel,torch_empty_zero,bare_hugetlb_madvise,bare_shm_populate,bare_anon_populate

bench: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/populate.py
	$(PY) bench/populate.py --pages natural --variants $(POPULATE_STATES) --output bench/results/populate-natural.json
	-$(PY) bench/populate.py --pages cold --variants $(POPULATE_STATES) --output bench/results/populate-cold.json
	$(PY) bench/first_alloc.py
	$(PY) bench/overhead.py
	$(PY) bench/scrape.py
	$(PY) bench/exporter_scale.py
	$(PY) bench/exporter_pod.py
	-$(PY) bench/serve_probe.py
	$(PY) bench/serve_stop.py
	$(PY) bench/tls_scrape.py
	$(PY) bench/share.py
	$(PY) bench/leakcheck.py
	$(PY) bench/make_run.py
	-$(PY) bench/gpu_pin.py
	$(VLLM_PY) bench/vllm_offload.py
	$(PY) bench/broker_restart.py --engine
	$(PY) bench/report.py

soak: $(STAMP)
	HOSTPOOL_SOAK=1 $(PY) -m pytest tests/reliability -q
	$(PY) bench/report.py --only soak --only procfs-attacks

dashboards: $(STAMP)
	$(PY) dashboards/build.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info
