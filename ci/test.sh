#!/usr/bin/env bash
# All tests: sets up .venv if needed, lints the series, then runs the tool's
# tests and the main job on the real series (every patch's regression test
# on the unpatched base and the patched tree). Offline once the vLLM release
# wheels are in pip's reach or in the tool's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh
.venv/bin/python apply.py check
exec .venv/bin/python -m pytest -q -ra tests "$@"
