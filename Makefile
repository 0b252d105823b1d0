# The two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# The project's own pins (torch's CPU build), for this install only: users get pyproject's ranges.
CONSTRAINTS = tools/constraints-dev.txt
PYTEST_ARGS ?=
# The suite on two worker processes: a module per worker at a time, tests/sglang on one worker
# (tests/conftest.py deals them out). PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
PYTEST_PAR = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))

.PHONY: demo test test-gpu lint venv clean bench sglang-env python-envs

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	@# Real engines: installed when the platform has them; tests skip cleanly where it has not.
	-$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[mooncake,nixl]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP) lint sglang-env python-envs
	$(PY) -m pytest $(PYTEST_PAR) $(PYTEST_ARGS)

# Pools on a GPU moved by NIXL with device digests (skipped where there is no CUDA GPU).
test-gpu: $(STAMP)
	$(PY) -m pytest tests/gpu -v -rs $(PYTEST_ARGS)

# Real SGLang 0.5.19 and 0.5.23 for tests/sglang, cached in $(VENV)/sglang-env and
# $(VENV)/sglang-env-0.5.23 (stamped; never touches the venv).
sglang-env: $(STAMP)
	-bash tools/sglang_env.sh $(PY) $(VENV)/sglang-env
	-bash tools/sglang_env.sh $(PY) $(VENV)/sglang-env-0.5.23 0.5.23

# Python 3.10 and 3.12 for tests/unit/test_pythons.py (the torch-free surface): cached torch-free
# venvs $(VENV)/py3.10 and $(VENV)/py3.12 (stamped; never touches the venv).
python-envs:
	-bash tools/python_env.sh python3.10 $(VENV)/py3.10
	-bash tools/python_env.sh python3.12 $(VENV)/py3.12

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(STAMP)
	$(VENV)/bin/pdstate demo

bench: $(STAMP)
	$(VENV)/bin/pdstate bench --quick

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
