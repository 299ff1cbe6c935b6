# kdagen: everything this project needs is installed from here (and pyproject.toml).
#   make all    set up .venv, generate, build and verify the default spec (SPEC=...)
#   make test   run the test suite (GPU/NPU tests skip themselves without the hardware)
PYTHON ?= python3
VENV   ?= .venv
SPEC   ?= specs/ci.yaml
# The CPU wheel of torch (on disk on CI machines); override with TORCH= on other machines,
# or TORCH= (empty) to keep a torch that is already importable.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
KDAGEN := $(BIN)/kdagen

.PHONY: all setup generate check build verify test clean
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
	@if command -v nvcc >/dev/null 2>&1; then $(KDAGEN) build --spec specs/a100.yaml; fi
	$(BIN)/python -m pytest -q

clean:
	rm -rf build
