# The commands of the README: `make demo`, `make test` (the fast tier) and `make test-long` (the
# long tier). Each creates .venv when needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: test test-long demo bench-quick lint clean llama-server

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

# The suite in two tiers; together they run every test once (tests/test_tiers.py reads the
# commands below). The model tests of tests/lua (FLEETGATE_MODEL_EXAMPLES) run in the fast tier at
# a smaller budget and again in the long tier's hunt at full size.
FAST_EXAMPLES ?= 100
HUNT_EXAMPLES ?= 2000
DURATIONS ?= 25

# The fast tier: every test not marked long, all of tests/lua and the multi-process cap tests of
# every layer included; <= 10 min on 2 cores, no llama-server needed.
test: $(BIN)/.installed
	FLEETGATE_MODEL_EXAMPLES=$(FAST_EXAMPLES) $(BIN)/pytest -q -m "not long" --durations=$(DURATIONS)

# The long tier: the tests marked long (real llama-server, chaos, soak, Prometheus end to end,
# slow load and burst tests; llama-server is built first, once, cached), then the model hunt.
test-long: $(BIN)/.installed llama-server
	$(BIN)/pytest -q -m long --durations=$(DURATIONS)
	FLEETGATE_MODEL_EXAMPLES=$(HUNT_EXAMPLES) $(BIN)/pytest -q --durations=$(DURATIONS) \
	  tests/lua/test_transitions_model.py tests/lua/test_token_budget_model.py

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
