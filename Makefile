# The two commands of the README: `make demo` and `make test`. Both create .venv when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test demo bench-quick lint clean llama-server

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

# The whole suite, tests/real_server/ included: llama-server is built first (once, cached).
test: $(BIN)/.installed llama-server
	$(BIN)/pytest -q

# llama.cpp's llama-server (from the PyPI sdist of llama-cpp-python, ~9-11 min on 2 cores) and a
# random-weight GGUF for tests/real_server/, cached under ~/.cache/fleetgate/: a second run does
# nothing. Where it cannot be built (no cmake or C++ compiler) it says so and those tests skip,
# saying so; with FLEETGATE_REQUIRE_REAL_SERVER=1 (CI) both fail instead.
llama-server: $(BIN)/.installed
	$(BIN)/python .ci/llama_server.py

demo: $(BIN)/.installed
	$(BIN)/python -m fleetgate.demo

bench-quick: $(BIN)/.installed
	$(BIN)/python -m benchmarks --quick

# ruff over the checkout; mypy --strict over fleetgate, fleetgate.client and fleetgate.coordinator
# as installed (the script maps the root folders to their package names, which mypy cannot);
# pylint's duplicate-code check (R0801) alone over the product code: six lines repeated fail it.
lint: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[lint]'
	$(BIN)/ruff check .
	$(BIN)/python .ci/typecheck.py
	$(BIN)/pylint --disable=all --enable=duplicate-code --min-similarity-lines=6 \
	  --ignore-imports=yes --ignore-signatures=yes --ignore-docstrings=yes --ignore-comments=yes \
	  --score=no fleetgate client coordinator proxy tools demo testing cli

clean:
	rm -rf $(VENV) build *.egg-info
