# The two commands of the README: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test demo bench-quick lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

test: $(BIN)/.installed
	$(BIN)/pytest -q

demo: $(BIN)/.installed
	$(BIN)/python -m fleetgate.demo

bench-quick: $(BIN)/.installed
	$(BIN)/python -m benchmarks --quick

lint: $(BIN)/.installed
	$(BIN)/pip install -q mypy ruff
	$(BIN)/ruff check .
	$(BIN)/mypy fleetgate client coordinator

clean:
	rm -rf $(VENV) build *.egg-info
