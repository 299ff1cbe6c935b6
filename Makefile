# kdagen: everything this project needs is installed from here (and pyproject.toml).
#   make all    set up .venv, generate, build and verify the default spec (SPEC=...)
#   make test   run the test suite (GPU/NPU tests skip themselves without the hardware)
#   make wheel-check   build the wheel, install it in a fresh venv outside the tree, run it from elsewhere
PYTHON ?= python3
VENV   ?= .venv
SPEC   ?= specs/ci.yaml
# The CPU wheel of torch (on disk on CI machines); override with TORCH= on other machines,
# or TORCH= (empty) to keep a torch that is already importable.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
KDAGEN := $(BIN)/kdagen

.PHONY: all setup generate check build verify test wheel-check clean
all: setup generate build verify

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH)" ]; then echo "installing $(TORCH)"; $(BIN)/python -m pip install -q "$(TORCH)"; fi
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $@

generate: setup
	$(KDAGEN) generate --spec $(SPEC)

check: setup
	$(KDAGEN) generate --all --check

build: setup
	$(KDAGEN) build --spec $(SPEC)

verify: setup
	$(KDAGEN) verify --spec $(SPEC)

# The sm80 ptxas checks read the build of specs/a100.yaml: build it first where nvcc exists
# (incremental: a no-op when nothing changed).
test: setup
	@if command -v nvcc >/dev/null 2>&1; then $(KDAGEN) build --spec specs/a100.yaml && $(KDAGEN) build --spec specs/sm90_dev.yaml; fi
	$(BIN)/python -m pytest -q

# The package as a user gets it: the wheel in a fresh virtual environment outside the source
# tree, run from another folder with its own cache: doctor, an ahead-of-time build into the
# cache, and a CPU call against the float64 reference.
WHEEL_DIR ?= /tmp/kdagen-wheel-check
WHEEL_RUN := cd $(WHEEL_DIR) && KDAGEN_CACHE_DIR=$(WHEEL_DIR)/cache TRITON_INTERPRET=1
# setuptools stages the package in build/lib and build/bdist.* and never removes what the tree
# no longer has (a deleted spec shipped again): both are cleared first.
wheel-check: setup
	rm -rf $(WHEEL_DIR) build/lib build/bdist.* && mkdir -p $(WHEEL_DIR)
	$(BIN)/python -m pip wheel -q --no-deps -w $(WHEEL_DIR)/dist .
	$(PYTHON) -m venv $(WHEEL_DIR)/venv
	@if [ -n "$(TORCH)" ]; then $(WHEEL_DIR)/venv/bin/python -m pip install -q "$(TORCH)"; fi
	$(WHEEL_DIR)/venv/bin/python -m pip install -q $(WHEEL_DIR)/dist/kdagen-*.whl "triton>=3.2,<=3.6.0" "numpy>=1.24,<2.4"
	$(WHEEL_RUN) venv/bin/kdagen doctor
	$(WHEEL_RUN) venv/bin/kdagen build --spec ci --filter 'kda_fwd_triton_c16_k32_v32_fp32_gb_sfp32_bv16'
	$(WHEEL_RUN) venv/bin/python $(CURDIR)/.ci/wheel_smoke.py

clean:
	rm -rf build
