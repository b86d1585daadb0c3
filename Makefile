# Thin wrapper. `make demo` runs a real refit; `make test` installs everything and runs every test.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint bench schema crds clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/dcr refit --kill-receiver-every 2

test: install
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: install
	$(PY) bench/codec.py
	$(PY) bench/apply.py
	$(PY) bench/protocol.py

# Regenerate the manifest JSON schema from its pydantic model (a test keeps them in sync).
schema: install
	$(PY) -c "from dcr.format.manifest import SCHEMA_PATH, json_schema; SCHEMA_PATH.write_text(json_schema())"

# Regenerate crds/ and charts/dcr/crds/ from the operator's pydantic models (a test keeps
# them in sync).
crds: install
	$(PY) -m dcr_operator.crds

clean:
	rm -rf $(VENV) refit-out .mypy_cache .ruff_cache .pytest_cache .hypothesis
