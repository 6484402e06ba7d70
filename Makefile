# rljob developer entry points. Every target installs what it needs, idempotently:
#   make quickstart   train the tiny policy with APRIL on CPU and compare against sync rollouts
#   make test         lint, then all tests (unit, integration with the local control plane, its real node and Prometheus)
#   make lint         ruff and mypy on the packages (api, common, runtime, operator)
#   make images REGISTRY=registry.example.com/ml   build every image and push it (no REGISTRY: save archives;
#                     PLAN=1: print the commands and the chart values only; IMAGES_ARGS: more options of
#                     images/build_images.py, e.g. "--only operator --build-arg PYTHON_IMAGE=<your mirror>")
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The stamp changes when the dependency list changes, so `pip install` reruns only then.
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml setup.py | sha1sum | cut -c1-12)
export RLJOB_CACHE ?= $(HOME)/.cache/rljob

.PHONY: install quickstart test unit lint cluster-build cluster-images cluster-up cluster-down benchmark crds images

# A fresh virtualenv holds 5.6 GB (torch's CUDA wheels), and pip keeps its downloads meanwhile: with
# less free than the venv itself, stop at once with what to do instead of pip's ENOSPC half-way.
VENV_GB := 6
$(STAMP):
	@test -x $(BIN)/python || { free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); test $$free -ge $(VENV_GB) || \
	  { echo "make install: a fresh $(VENV) needs $(VENV_GB) GB free here (about 9 GB while pip downloads), and $$free GB is: free some (df -h .) and rerun" >&2; exit 1; }; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

quickstart: install
	$(BIN)/rljob run docs/examples/quickstart.yaml --fresh --compare-rounds 4

# Every image of images/ (buildah, else docker), pushed to $(REGISTRY) or saved under $(IMAGES_OUT).
REGISTRY    ?=
IMAGES_OUT  ?= dist/images
IMAGES_ARGS ?=
images: install
	$(BIN)/python images/build_images.py --registry "$(REGISTRY)" --out "$(IMAGES_OUT)" $(if $(PLAN),--plan) $(IMAGES_ARGS)

cluster-build:
	tests/cluster/localkube.sh build

# Images of the real-node tests (buildah, no registry), cached by a hash of their inputs.
cluster-images: cluster-build
	tests/cluster/localkube.sh images pause busybox base-python operator

cluster-up: cluster-build
	tests/cluster/localkube.sh up

cluster-down:
	tests/cluster/localkube.sh down

unit: install
	$(BIN)/python -m pytest tests/unit -q

# mypy reads the packages under their rljob.* names through links (setup.py maps the folders); its cache
# stays in .mypy_cache, so a rerun checks only what changed.
LINT_PACKAGES := api common runtime operator
lint: install
	$(BIN)/ruff check $(LINT_PACKAGES)
	@mkdir -p .mypy_cache/pkgroot/rljob
	@for top in $(LINT_PACKAGES); do ln -sfn ../../../$$top .mypy_cache/pkgroot/rljob/$$top; done
	MYPYPATH=.mypy_cache/pkgroot $(BIN)/mypy $(foreach top,$(LINT_PACKAGES),-p rljob.$(top))

# The set-up runs two targets at a time: cold, the pip install and mypy (~4 min) run beside the Go builds
# (~20 min) instead of before them.
test:
	$(MAKE) --no-print-directory -j2 lint cluster-images
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25

benchmark: install
	$(BIN)/python benchmarks/rollout_throughput.py

crds: install
	$(BIN)/python -m rljob.operator.crdgen
	$(BIN)/python charts/tools/chart_sync.py
